"""Constrained decoding without a model: grammars compiled from the real tokenizers, masks applied by the
sampler to random logits, drafts checked by the scheduler, and the stop rule of a completed grammar."""

import json
import random

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from service.core.config import EngineConfig
from service.core.grammar import CACHE_SIZE, MAX_SPEC_BYTES, GrammarCompiler, ResponseFormat, allowed
from service.core.kv_cache import KVCacheManager
from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.sampler import sample, verify
from service.core.scheduler import Scheduler
from service.core.spec import Guess
from service.core.stop import stop_reason
from service.errors import InvalidArgument
from tests.support.schemas import SCHEMAS

VOCAB = 151936  # the Qwen3 model's logits rows: more than the tokenizer's 151,669 ids
EOS = (151645, 151643)


@pytest.fixture(scope="module")
def qwen(tiny_qwen3_ir):
    return GrammarCompiler((tiny_qwen3_ir / "tokenizer.json").read_text(), VOCAB, EOS)


@pytest.fixture(scope="module")
def smollm2(smollm2_ir):
    return GrammarCompiler((smollm2_ir / "tokenizer.json").read_text(), 49152, (2,))


def constrained(compiler, fmt, rid=0, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params), matcher=compiler.matcher(fmt))


def generate(compiler, fmt, rng, steps=200, **params) -> list[int]:
    """Sample token by token from random logits under the format's masks, as the engine does."""
    request = constrained(compiler, fmt, **params)
    while request.num_output_tokens < steps:
        logits = rng.normal(size=(1, compiler.vocab_size)).astype(np.float32) * 5
        token = sample(logits, [request], [request.matcher.masks()]).token_ids[0]
        request.append_token(token)
        request.matcher.advance(token)
        if token in EOS or request.matcher.done:
            break
    return request.output_token_ids


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_logits_under_a_schema_give_valid_json(qwen, tiny_qwen3_ir, name):
    """Whatever the logits say (random, at temperature 1.5), the reply parses and validates."""
    decode = HFTokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json")).decode
    fmt = ResponseFormat.json_schema(json.dumps(SCHEMAS[name]))
    rng = np.random.default_rng(0)
    for seed in range(3):
        ids = generate(qwen, fmt, rng, temperature=1.5, seed=seed)
        jsonschema.validate(json.loads(decode(ids)), SCHEMAS[name])


def test_the_byte_level_vocabulary_is_read_as_the_tokenizer_decodes_it(smollm2, qwen, smollm2_ir, tiny_qwen3_ir):
    """A token's bytes in the grammar are its text in replies: spaces (Ġ), non-ASCII and added tokens."""
    for compiler, folder in ((smollm2, smollm2_ir), (qwen, tiny_qwen3_ir)):
        hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        ids = random.Random(0).sample(range(hf.get_vocab_size(with_added_tokens=False)), 2000)
        words = ["Ġthe", 'Ġ{"', "ĊĊ", "Ã©"]
        ids += [hf.token_to_id(w) for w in words if hf.token_to_id(w) is not None]
        ll = compiler.tokenizer
        for token in ids:
            text = hf.decode([token], skip_special_tokens=False)
            if "\ufffd" not in text:  # a lone part of a multi-byte character has no text of its own
                assert ll.decode_bytes([token]) == text.encode(), (token, text)
        added = max(hf.get_added_tokens_decoder())
        assert ll.decode_str([added]) == hf.decode([added], skip_special_tokens=False)


def test_invalid_formats_name_the_field_and_reason(qwen):
    cases = [
        (ResponseFormat.json_schema('{"type": "wat"}'), "response_format.json_schema", "wat"),
        (ResponseFormat.json_schema("{not json"), "response_format.json_schema", "JSON"),
        (ResponseFormat.json_schema("[1, 2]"), "response_format.json_schema", "object"),
        (ResponseFormat.regex("a(b"), "response_format.regex", "regex"),
        (ResponseFormat.json_schema(json.dumps({"enum": ["x" * 100] * 700})), "response_format.json_schema", "limit"),
    ]
    for fmt, field, words in cases:
        with pytest.raises(InvalidArgument) as err:
            qwen.matcher(fmt)
        assert err.value.field == field and words in str(err.value), str(err.value)
    with pytest.raises(InvalidArgument, match=f"the limit is {MAX_SPEC_BYTES}"):
        qwen.compile(ResponseFormat.regex("a" * (MAX_SPEC_BYTES + 1)))
    with pytest.raises(InvalidArgument, match="at least one"):
        ResponseFormat.choice([])


def test_compiled_grammars_are_cached_by_canonical_schema_within_a_bound(qwen):
    a = qwen.compile(ResponseFormat.json_schema('{"type": "object", "properties": {"x": {"type": "integer"}}}'))
    b = qwen.compile(ResponseFormat.json_schema('{"properties":{"x":{"type":"integer"}},"type":"object"}'))
    assert a is b  # the same schema with other spacing and key order compiles once
    for i in range(CACHE_SIZE + 5):
        qwen.compile(ResponseFormat.regex(f"x{i}"))
    assert len(qwen._cache) == CACHE_SIZE


def test_choice_and_regex_masks_allow_only_their_continuations(qwen, tiny_qwen3_ir):
    decode = HFTokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json")).decode
    rng = np.random.default_rng(1)
    for _ in range(5):
        ids = generate(qwen, ResponseFormat.choice(["positive", "negative", "neutral"]), rng, temperature=2.0)
        assert decode(ids) in ("positive", "negative", "neutral")
        ids = generate(qwen, ResponseFormat.regex(r"[0-9]{3}-[a-z]{2}"), rng, temperature=2.0)
        text = decode([t for t in ids if t not in EOS])
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-"


def test_a_grammar_admitting_only_eos_ends_the_reply_at_once(qwen):
    """The empty regex: eos is the only token allowed, even against min_new_tokens (the grammar wins)."""
    request = constrained(qwen, ResponseFormat.regex(""), min_new_tokens=5)
    logits = np.random.default_rng(2).normal(size=(1, VOCAB)).astype(np.float32)
    token = sample(logits, [request], [request.matcher.masks()]).token_ids[0]
    assert token in EOS
    request.append_token(token)
    request.matcher.advance(token)
    assert request.matcher.done and stop_reason(request, 100) is FinishReason.STOP


def test_a_completed_grammar_stops_the_reply_without_eos(qwen, tiny_qwen3_ir):
    hf = HFTokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json"))
    request = constrained(qwen, ResponseFormat.choice(["yes"]), ignore_eos=True)
    for token in hf.encode("yes", add_special_tokens=False).ids:
        assert stop_reason(request, 100) is None if request.output_token_ids else True
        request.append_token(token)
        request.matcher.advance(token)
    assert stop_reason(request, 100) is FinishReason.STOP


def test_verify_masks_every_position_and_rejects_a_forbidden_bonus(qwen, tiny_qwen3_ir):
    """Each verified position is sampled under its own mask: the model's favourite token, forbidden by the
    grammar, is never emitted."""
    hf = HFTokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json"))
    request = constrained(qwen, ResponseFormat.choice(["ab cd"]))
    drafts = hf.encode("ab", add_special_tokens=False).ids
    rows = np.zeros((len(drafts) + 1, VOCAB), dtype=np.float32)
    favourite = hf.token_to_id("Ġzz") or 9
    rows[:, favourite] = 100.0  # the model wants a token the grammar never allows
    out = verify(rows, request, drafts, request.matcher.masks(drafts))
    assert out.token_ids[: len(drafts)] == drafts and favourite not in out.token_ids
    assert hf.decode(out.token_ids).startswith("ab ")


class FixedProposer:
    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, token_ids, k):
        return Guess(tuple(self.tokens[:k]))


def test_the_scheduler_offers_only_drafts_the_grammar_admits(qwen, tiny_qwen3_ir):
    hf = HFTokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json"))
    good = hf.encode('{"a"', add_special_tokens=False).ids
    forbidden = hf.encode("zz", add_special_tokens=False).ids
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=64, speculation="auto", speculative_tokens=4, speculative_max_seqs=4
    )
    s = Scheduler(config, KVCacheManager(32, 4), 64, proposer=FixedProposer([]))
    s.step_times.prior_overhead = 1000.0  # drafts as good as free: the rule offers all the proposer has
    request = constrained(qwen, ResponseFormat.json_object())
    s.add(request)
    plan = s.schedule()
    assert plan.chunks[0].drafts == ()  # the prompt step samples the first token
    s.update(plan, [[good[0]]])
    s.proposer = FixedProposer([*good[1:], *forbidden])
    plan = s.schedule()
    assert plan.chunks[0].drafts == tuple(good[1:])  # cut before the first token the grammar forbids


def test_a_broken_matcher_reports_its_error_instead_of_raising(qwen, tiny_qwen3_ir):
    """A matcher that stopped working (here: fed a token outside its grammar, as a grammar limit would stop it)
    says why through error, and still hands out masks, so the engine fails its request alone."""
    hf = HFTokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json"))
    matcher = qwen.matcher(ResponseFormat.choice(["yes"]))
    assert matcher.error == ""
    matcher.advance(hf.token_to_id("no"))
    assert matcher.error and "\n" not in matcher.error and len(matcher.error) <= 300  # a line for the client
    assert matcher.field == "response_format.choice"  # what the request's error names
    assert set(np.nonzero(allowed(matcher.masks(), VOCAB)[0])[0]) <= set(EOS)  # only eos: the reply can end


def test_a_pathological_expression_stops_at_the_lexers_limit_instead_of_stalling_every_request(smollm2, smollm2_ir):
    """`(a{700}){700}` is 13 bytes; with llguidance's default limits its masks took seconds of the engine's time.
    Under the server's limits its matcher stops within a few tokens with an error naming the limit (its request
    fails alone), or is refused before it is queued; an ordinary expression of the same shape is untouched."""
    a = HFTokenizer.from_file(str(smollm2_ir / "tokenizer.json")).token_to_id("a")
    try:
        matcher = smollm2.matcher(ResponseFormat.regex("(a{700}){700}"))
    except InvalidArgument as refused:
        assert refused.field == "response_format.regex" and "too complex" in str(refused)
    else:
        for _ in range(3):
            if matcher.error:
                break
            matcher.masks()
            matcher.advance(a)
        assert "too many expressions" in matcher.error
    ordinary = smollm2.matcher(ResponseFormat.regex("(a{7}){7}"))
    for _ in range(49):
        ordinary.advance(a)
    assert ordinary.error == "" and ordinary.done
