"""Same request, same reply, at default settings on the default model (SmolLM2 int8, u8 cache, f32 activations,
deterministic steps): a greedy or seeded reply does not depend on whether its prefix was computed, found in RAM
or restored from disk, on what shares its steps (alone, beside 8 and beside 32), on speculation, on
preemption, or on the protocol (unary or streamed, gRPC or HTTP). On an AVX2 host, the code before
deterministic steps failed the checks beside others, with speculation and after preemption."""

import asyncio
import dataclasses
import random

import openai
import pytest

from service.client import Client
from service.core.config import EngineConfig
from service.core.params import SamplingParams
from service.engine import Engine
from tests.support.engine import collect
from tests.support.servers import TIMEOUT, Running, base_config, free_port

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing a clear email.",
    "Explain what a prime number is.",
    "Rewrite this sentence more politely: send me the report now.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What should I pack for a weekend hiking trip?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]
NEW = 48
GREEDY = SamplingParams(max_new_tokens=NEW)
SEEDED = SamplingParams(max_new_tokens=NEW, temperature=0.7, seed=1)
LONG = SamplingParams(max_new_tokens=NEW, ignore_eos=True)  # replies that fill their blocks


def chats(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def others(n: int) -> list[list[int]]:
    """Requests to share the steps: random prompts of 20 to 120 tokens of SmolLM2's vocabulary."""
    rng = random.Random(n)
    return [[rng.randrange(100, 49_000) for _ in range(rng.randint(20, 120))] for _ in range(n)]


async def reply(engine: Engine, prompt: list[int], params: SamplingParams, salt: str = "") -> list[int]:
    tokens, _, _ = await collect(engine, prompt, params, cache_salt=salt)
    return tokens


def one_by_one(engine: Engine, prompts: list[list[int]], params: SamplingParams, salt: str = "") -> list[list[int]]:
    """Each prompt alone; a salt of its own per prompt when salt is given (nothing cached: a cold prefill)."""

    async def main():
        return [await reply(engine, p, params, f"{salt}{i}" if salt else "") for i, p in enumerate(prompts)]

    return asyncio.run(main())


def beside(engine: Engine, prompts: list[list[int]], params: SamplingParams, crowd: int) -> list[list[int]]:
    """The prompts all at once, among `crowd` other requests decoding 64 tokens."""

    async def main():
        busy = SamplingParams(max_new_tokens=64, ignore_eos=True)
        tasks = [asyncio.create_task(reply(engine, p, busy)) for p in others(crowd)]
        mine = await asyncio.gather(*(reply(engine, p, params) for p in prompts))
        await asyncio.gather(*tasks)
        return mine

    return asyncio.run(main())


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def served(smollm2_ir, disk_dir):
    """An engine at default settings but its disk tier, and its cold replies: each prompt alone, nothing cached."""
    engine = Engine(smollm2_ir, EngineConfig(kv_disk_dir=str(disk_dir)))
    engine.start()
    prompts = chats(engine)
    cold = {"greedy": one_by_one(engine, prompts, GREEDY, "cold"), "seeded": one_by_one(engine, prompts, SEEDED, "c")}
    yield engine, prompts, cold
    engine.shutdown()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_cached_prefix_gives_the_cold_reply(served, kind):
    engine, prompts, cold = served
    params = GREEDY if kind == "greedy" else SEEDED
    hits = engine.stats().num_cached_prompt_tokens
    first, again = one_by_one(engine, prompts, params), one_by_one(engine, prompts, params)
    assert engine.stats().num_cached_prompt_tokens > hits + sum(map(len, prompts)) // 2
    assert sum(r == c for r, c in zip(first, cold[kind], strict=True)) == len(prompts)
    assert sum(r == c for r, c in zip(again, cold[kind], strict=True)) == len(prompts)


@pytest.mark.parametrize("crowd", [8, 32])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_what_shares_the_steps_does_not_change_a_reply(served, kind, crowd):
    engine, prompts, cold = served
    replies = beside(engine, prompts, GREEDY if kind == "greedy" else SEEDED, crowd)
    assert sum(r == c for r, c in zip(replies, cold[kind], strict=True)) == len(prompts)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_speculation_does_not_change_a_reply(served, kind):
    engine, prompts, cold = served
    params = dataclasses.replace(GREEDY if kind == "greedy" else SEEDED, speculation="auto")
    drafted = engine.stats().num_draft_tokens
    replies = one_by_one(engine, prompts, params, "spec")
    assert sum(r == c for r, c in zip(replies, cold[kind], strict=True)) == len(prompts)
    if kind == "greedy":
        assert engine.stats().num_draft_tokens > drafted  # drafts were verified (sampled ones get none)


def test_the_next_turn_reads_the_last_reply_from_the_cache_and_replies_as_cold(served):
    """A conversation's second turn finds the first turn's prompt and reply in the cache (the reply was computed
    one token a step, and a cold prompt computes an assistant's turn the same way), and replies what the same
    prompt replies cold."""
    engine, _, _ = served
    params = SamplingParams(max_new_tokens=64)
    first = [{"role": "user", "content": "Give me five tips for writing a clear email, one line each."}]
    prompt = engine.tokenizer.encode_chat(first)
    answer = asyncio.run(reply(engine, prompt, params))
    conversation = [
        *first,
        {"role": "assistant", "content": engine.tokenizer.decode(answer)},
        {"role": "user", "content": "Now make the third tip shorter."},
    ]
    turn = engine.tokenizer.encode_chat(conversation)
    hits = engine.stats().num_cached_prompt_tokens
    warm = asyncio.run(reply(engine, turn, params))
    reused = engine.stats().num_cached_prompt_tokens - hits
    assert reused > len(prompt) + engine.info.block_size  # a block past the first prompt: the reply's
    assert warm == asyncio.run(reply(engine, turn, params, salt="cold-turn"))


def test_a_restored_prefix_gives_the_cold_reply(served, smollm2_ir, tmp_path):
    """A server computes the prompts and stops; after a restart on the same disk folder their blocks come from
    disk, and the replies are the cold ones."""
    _, prompts, cold = served
    for restart in (False, True):
        engine = Engine(smollm2_ir, EngineConfig(kv_disk_dir=str(tmp_path)))
        engine.start()
        try:
            replies = one_by_one(engine, prompts, GREEDY)
            assert (engine.stats().num_restored_prompt_tokens > 0) == restart
        finally:
            engine.shutdown()  # the blocks filled reach the disk first
        assert sum(r == c for r, c in zip(replies, cold["greedy"], strict=True)) == len(prompts)


def test_preemption_does_not_change_a_reply(smollm2_ir):
    """A KV cache of 5 blocks for 8 requests of about 100 tokens: requests are preempted and recomputed, and reply
    what they reply alone with room for all."""
    roomy = Engine(smollm2_ir, EngineConfig(enable_prefix_caching=False))
    roomy.start()
    try:
        prompts = chats(roomy)
        alone = one_by_one(roomy, prompts, LONG)
        block_bytes = roomy.info.kv_cache_bytes / (roomy.info.num_kv_blocks + 1)
    finally:
        roomy.shutdown()
    tight = Engine(smollm2_ir, EngineConfig(enable_prefix_caching=False, kv_cache_gb=6 * block_bytes / 2**30))
    tight.start()
    try:
        replies = beside(tight, prompts, LONG, 0)
        assert tight.stats().num_preemptions > 0
    finally:
        tight.shutdown()
    assert sum(r == a for r, a in zip(replies, alone, strict=True)) == len(prompts)


def test_streamed_and_unary_replies_agree_over_grpc_and_http(smollm2_ir):
    """A server at default settings: the same chat request unary and streamed, over gRPC and HTTP (the later
    calls find the prompt cached), gives one reply."""
    running = Running(base_config(smollm2_ir, kv_cache_gb=1.0, http_port=free_port()))
    try:
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{running.server.http.port}/v1", api_key="-", timeout=TIMEOUT)
        model = http.models.list().data[0].id
        for question in QUESTIONS[:4]:
            messages = [{"role": "user", "content": question}]
            with Client(running.target) as client:
                unary = client.generate(messages=messages, max_new_tokens=NEW, timeout=TIMEOUT).text
                streamed = "".join(c.text for c in client.stream(messages=messages, max_new_tokens=NEW))
            asked = {"model": model, "messages": messages, "max_tokens": NEW, "temperature": 0}
            whole = http.chat.completions.create(**asked).choices[0].message.content
            pieces = http.chat.completions.create(**asked, stream=True)
            joined = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
            assert unary == streamed == whole == joined, question
    finally:
        running.stop()
