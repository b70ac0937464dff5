"""n (several candidates for one prompt, computed once) and logit_bias, on a real SmolLM2 int8 server with the
prefix cache on, through the openai SDK and the gRPC client."""

import uuid

import grpc
import httpx
import openai
import pytest

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import Client
from tests.support.servers import TIMEOUT, Running, base_config, free_port, wait_idle

# longer than two KV blocks of 32: the candidates share its full blocks
STORY = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who had a little boat, a "
    "grey cat and a garden full of tomatoes. Every morning he rowed out before dawn and came back at noon."
)


@pytest.fixture(scope="module")
def server(smollm2_ir):
    running = Running(base_config(smollm2_ir, http_port=free_port(), metrics_port=free_port(), max_num_seqs=8))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def sdk(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def model(server):
    return server.engine.info.model_id


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def fresh(text: str = STORY) -> list[dict[str, str]]:
    """A prompt nothing has cached yet (a new first line), so that what is shared is this request's doing."""
    return ask(f"Request {uuid.uuid4().hex}.\n{text}\nContinue the story.")


GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


# -- logit_bias --------------------------------------------------------------------------------------------
def test_minus_100_bans_a_token_the_greedy_reply_uses_and_plus_100_forces_one(client, sdk, model, server):
    messages = ask("What is the capital of France?")
    plain = client.generate(messages=messages, **GREEDY)
    used = plain.token_ids[1]
    banned = client.generate(messages=messages, logit_bias={used: -100.0}, **GREEDY)
    assert used not in banned.token_ids and banned.text != plain.text
    forced_id = client.tokenize(text=" banana")[-1]
    forced = client.generate(messages=messages, logit_bias={forced_id: 100.0}, **GREEDY)
    assert list(forced.token_ids) == [forced_id] * 10
    # the same through the openai SDK (ids as string keys), on the same engine
    over_http = sdk.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        logit_bias={str(used): -100},
        extra_body={"ignore_eos": True},
    )
    assert over_http.choices[0].message.content == banned.text
    wait_idle(server.engine)


def test_a_bias_with_speculation_gives_the_reply_without_it(client, server):
    """Greedy replies with drafts verified are those without: the verify step samples the same biased rows."""
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the sun all day."
    bias = {client.tokenize(text=" lazy")[-1]: -100.0, client.tokenize(text=" cat")[-1]: 4.0}
    options = {"max_new_tokens": 40, "temperature": 0.0, "logit_bias": bias, "messages": ask(text)}
    before = server.engine.stats().num_draft_tokens
    with_drafts = client.generate(speculation="auto", **options)
    assert server.engine.stats().num_draft_tokens > before  # drafts were really verified
    without = client.generate(speculation="off", **options)
    assert list(with_drafts.token_ids) == list(without.token_ids)
    assert client.tokenize(text=" lazy")[-1] not in with_drafts.token_ids


def test_a_bias_never_lets_through_what_a_response_format_forbids(client, sdk, model):
    choice = pb.ResponseFormat(choice=pb.Choice(options=["yes", "no"]))
    messages = ask("Is the sky blue? Answer yes or no.")
    forced_id = client.tokenize(text=" banana")[-1]
    reply = client.generate(messages=messages, response_format=choice, logit_bias={forced_id: 100.0}, **GREEDY)
    assert reply.text in ("yes", "no")
    plain = client.generate(messages=messages, response_format=choice, **GREEDY)
    other = client.generate(
        messages=messages, response_format=choice, logit_bias={plain.token_ids[0]: -100.0}, **GREEDY
    )
    assert {plain.text, other.text} == {"yes", "no"}  # within the format, the bias still decides
    body = sdk.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        logit_bias={str(plain.token_ids[0]): -100},
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert body.choices[0].message.content == other.text


@pytest.mark.parametrize(
    ("bias", "field"),
    [
        ({10**9: 1.0}, "logit_bias.1000000000"),
        ({-3: 1.0}, "logit_bias.-3"),
        ({5: 100.5}, "logit_bias.5"),
        ({5: float("nan")}, "logit_bias.5"),
        ({i: 1.0 for i in range(301)}, "logit_bias"),
    ],
)
def test_grpc_refuses_a_bad_logit_bias_naming_the_entry(client, bias, field):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt="Hi", logit_bias=bias, **GREEDY)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":")


def test_http_refuses_a_token_id_outside_the_vocabulary(sdk, model, server):
    vocab = server.engine.info.vocab_size
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=model, prompt="Hi", max_tokens=2, logit_bias={str(vocab): 5})
    assert err.value.body["param"] == f"logit_bias.{vocab}" and f"[0, {vocab})" in err.value.body["message"]


# -- n -----------------------------------------------------------------------------------------------------
def texts(body) -> list[str]:
    return [c.message.content for c in sorted(body.choices, key=lambda c: c.index)]


def test_seeded_n_gives_different_reproducible_candidates_each_the_reply_of_its_own_seed(sdk, model):
    options = {"model": model, "max_tokens": 16, "temperature": 1.0, "seed": 7}
    messages = ask("Write one sentence about the sea.")
    first = sdk.chat.completions.create(messages=messages, n=3, **options)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts(first))) == 3
    again = sdk.chat.completions.create(messages=messages, n=3, **options)
    assert texts(again) == texts(first)
    # candidate i is the reply of the same request with seed + i
    for i in range(3):
        alone = sdk.chat.completions.create(messages=messages, **options | {"seed": 7 + i})
        assert alone.choices[0].message.content == texts(first)[i]


def test_greedy_n_gives_identical_candidates_and_usage_counts_the_prompt_once(sdk, model):
    messages = ask("Name a colour.")
    one = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    three = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, n=3)
    assert texts(three) == [one.choices[0].message.content] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_the_prompt_is_computed_once_and_its_blocks_shared(sdk, model, server):
    engine = server.engine
    block = engine.info.block_size
    wait_idle(engine)
    before = engine.stats()
    reply = sdk.chat.completions.create(model=model, messages=fresh(), max_tokens=4, temperature=0, n=3)
    after = wait_idle(engine)
    prompt = reply.usage.prompt_tokens
    assert prompt > 2 * block
    shared = (prompt - 1) // block * block  # each later candidate reads the full blocks, computes the rest
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # nothing of this prompt was cached before
    assert reply.usage.prompt_tokens_details.model_extra["shared_tokens"] == 2 * shared
    assert after.num_shared_prompt_tokens - before.num_shared_prompt_tokens == 2 * shared
    assert after.num_prompt_tokens - before.num_prompt_tokens == prompt + 2 * (prompt - shared)
    metrics = httpx.get(server.url + "/metrics").text
    assert f"ovserve_shared_prompt_tokens_total {float(after.num_shared_prompt_tokens)}" in metrics


def test_streamed_n_tags_each_choice_and_ends_with_the_usage_of_all(sdk, model):
    stream = sdk.chat.completions.create(
        model=model,
        messages=ask("Say hello."),
        max_tokens=6,
        temperature=0.8,
        seed=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finishes, logprobs, usage = {0: "", 1: ""}, {}, {0: 0, 1: 0}, None
    roles = []
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.append(choice.index)
        text[choice.index] += choice.delta.content or ""
        if choice.logprobs is not None and choice.logprobs.content:
            logprobs[choice.index] += len(choice.logprobs.content)
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1] and set(finishes) == {0, 1}
    assert usage is not None and usage.completion_tokens == logprobs[0] + logprobs[1]
    whole = sdk.chat.completions.create(
        model=model, messages=ask("Say hello."), max_tokens=6, temperature=0.8, seed=3, n=2
    )
    assert texts(whole) == [text[0], text[1]]


def test_completions_take_n_too(sdk, model):
    body = sdk.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0, n=2)
    assert [c.index for c in body.choices] == [0, 1] and body.choices[0].text == body.choices[1].text


def test_grpc_n_streams_with_indexes_and_returns_choices(client, server):
    request = {"messages": fresh(), "max_new_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3}
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    usages = {}
    for message in client.stream(**request):
        streamed[message.index] += message.token_ids
        if message.finish_reason:
            usages[message.index] = message.usage
    whole = client.generate(**request)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [list(c.token_ids) for c in whole.choices] == [streamed[i] for i in range(3)]
    assert list(whole.token_ids) == streamed[0] and whole.index == 0
    prompt = whole.usage.prompt_tokens
    shared = (prompt - 1) // server.engine.info.block_size * server.engine.info.block_size
    assert [usages[i].cached_prompt_tokens for i in (1, 2)] == [shared, shared]  # read from the first's blocks
    assert whole.usage.completion_tokens == sum(c.usage.completion_tokens for c in whole.choices) == 18
    assert whole.usage.prompt_tokens == whole.choices[0].usage.prompt_tokens


def test_closing_a_stream_of_candidates_aborts_them_all_and_frees_every_block(client, sdk, model, server):
    long = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 1.0, "n": 4}
    stream = client.stream(messages=fresh(), **long)
    next(stream)
    stream.cancel()
    wait_idle(server.engine)
    http_stream = sdk.chat.completions.create(
        model=model, messages=fresh(), max_tokens=2000, n=4, stream=True, extra_body={"ignore_eos": True}
    )
    for _ in range(3):
        next(iter(http_stream))
    http_stream.close()
    s = wait_idle(server.engine)
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks)


@pytest.mark.parametrize("n", [0, -1, 1000, 9])
def test_n_outside_the_limit_is_refused_naming_it(client, sdk, model, n):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt="Hi", n=n, **GREEDY)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("n: must be in [1, 8]")
    with pytest.raises(openai.BadRequestError) as http_err:
        sdk.completions.create(model=model, prompt="Hi", max_tokens=2, n=n)
    assert http_err.value.body["param"] == "n" and "--max-n" in http_err.value.body["message"]
