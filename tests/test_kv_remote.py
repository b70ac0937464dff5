"""The fleet cache on the default model (SmolLM2 int8, u8 cache, deterministic steps) against a real
redis-server: replica A computes a conversation, replica B, which never saw it and has its own empty disk, answers
the next turn with the history's blocks fetched from the store, and its reply is A's. Corrupt values in the store
are caught and recomputed; a store that stops leaves the replicas serving; tenants' salts keep them apart; no
KV block is leaked however a request ends."""

import asyncio
import time

import pytest
from prometheus_client import generate_latest

from bench.replicas import Conversation, share_of_history, start_replicas
from service.client import Client
from service.core.params import SamplingParams
from service.engine import Engine, EngineConfig
from service.metrics import Metrics
from tests.support.engine import assert_no_blocks_held, collect
from tests.support.redis_server import RedisServer
from tests.support.servers import TIMEOUT

GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
RAM_GB = 0.012  # about 28 blocks of 32 tokens: a few conversations evict each other


def conversation(topic: str) -> list[dict[str, str]]:
    """A history of a few turns about topic (350-450 tokens), ending with the user's new message."""
    turns = []
    for i in range(5):
        turns.append({"role": "user", "content": f"Tell me something about {topic}, part {i + 1}, in detail."})
        turns.append(
            {
                "role": "assistant",
                "content": f"Here is part {i + 1} about {topic}: it has a long history, many people study it, and "
                f"there are several schools of thought about {topic} that disagree on the details.",
            }
        )
    return [*turns, {"role": "user", "content": f"Now summarize everything about {topic} in one sentence."}]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def make_engine(model, disk_dir, url: str | None, **kw) -> Engine:
    config = EngineConfig(
        kv_cache_gb=RAM_GB,
        kv_disk_dir=str(disk_dir) if disk_dir else None,
        kv_remote_url=url,
        kv_remote_timeout_seconds=0.5,
        **kw,
    )
    engine = Engine(model, config)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def replicas(smollm2_ir, store, tmp_path_factory):
    """Replica A and replica B: each its own RAM and its own disk folder, one store."""
    a = make_engine(smollm2_ir, tmp_path_factory.mktemp("disk-a"), store.url)
    b = make_engine(smollm2_ir, tmp_path_factory.mktemp("disk-b"), store.url)
    wait_for(lambda: a.core.tiers.remote.up and b.core.tiers.remote.up)
    yield a, b
    a.shutdown()
    b.shutdown()


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


async def generate(engine: Engine, prompt, **kw):
    tokens, _, last = await collect(engine, prompt, GREEDY, **kw)
    return tokens, last.usage


def run(engine: Engine, prompt, **kw):
    return asyncio.run(generate(engine, prompt, **kw))


def history(engine: Engine, topic: str) -> list[int]:
    return engine.tokenizer.encode_chat(conversation(topic))


def full_blocks(engine: Engine, prompt) -> int:
    """Prompt tokens a restore can cover: every full block but the one of the last token."""
    bs = engine.info.block_size
    return (len(prompt) - 1) // bs * bs


def computed_on_a(a: Engine, prompt, **kw):
    before = a.core.tiers.remote.store.counters.num_published
    out, usage = run(a, prompt, **kw)
    assert usage.cached_prompt_tokens == 0  # A computed it (nothing of it was anywhere)
    bs = a.info.block_size
    wait_for(lambda: a.core.tiers.remote.store.counters.num_published - before >= (len(prompt) + len(out) - 1) // bs)
    return out


def test_a_replica_that_never_saw_a_conversation_answers_it_from_the_store(replicas):
    a, b = replicas
    prompt = history(a, "lighthouses")
    assert len(prompt) > 300
    reply = computed_on_a(a, prompt)
    out, usage = run(b, prompt)
    n = full_blocks(b, prompt)
    assert out == reply
    assert (usage.cached_prompt_tokens, usage.remote_prompt_tokens, usage.disk_prompt_tokens) == (n, n, 0)
    assert_no_blocks_held(b)
    # the fetched blocks landed on B's disk: once B's RAM forgot them, they come from there
    wait_for(lambda: b.core.tiers.disk.store.num_blocks >= n // b.info.block_size)
    for topic in ("volcanoes", "glaciers", "deserts"):
        run(b, history(b, topic))
    out, usage = run(b, prompt)
    assert out == reply
    assert (usage.disk_prompt_tokens, usage.remote_prompt_tokens) == (n, 0)
    metrics = Metrics()
    metrics.attach(b)
    text = generate_latest(metrics.registry).decode()
    remote_tokens = float(b.stats().num_remote_prompt_tokens)
    assert f'ovserve_prompt_tokens_by_source_total{{source="remote"}} {remote_tokens}' in text
    assert "ovserve_kv_remote_up 1.0" in text
    assert b.stats().remote.num_corrupt == 0
    assert_no_blocks_held(b)


def test_corrupt_values_in_the_store_are_caught_and_the_reply_stays_exact(replicas, store):
    a, b = replicas
    prompt = history(a, "beekeeping")
    reply = computed_on_a(a, prompt)
    remote = a.core.tiers.remote.store
    digests = a.core.kv.full_block_digests(-1, prompt, "")
    a.core.kv.free(-1)  # (only the digests were wanted)
    client = store.client()
    value = bytearray(client.get(remote.key(digests[3])))
    value[-7] ^= 0x40
    client.set(remote.key(digests[3]), bytes(value))
    client.delete(remote.key(digests[5]))
    client.hset(remote.key(digests[5]), "hostile", "value")
    corrupt_before = b.stats().remote.num_corrupt
    out, usage = run(b, prompt)
    assert out == reply
    assert usage.remote_prompt_tokens == 3 * b.info.block_size  # the chain ends at the corrupt block
    assert b.stats().remote.num_corrupt == corrupt_before + 1
    # B computed the rest and published it: the store holds good values again
    wait_for(lambda: remote.fetch(digests[:6]) and len(remote.fetch(digests[:6])) == 6)
    assert_no_blocks_held(b)


def test_a_cache_salt_keeps_tenants_apart_in_the_store(replicas):
    a, b = replicas
    prompt = history(a, "origami")
    reply = computed_on_a(a, prompt, cache_salt="tenant-a")
    out, usage = run(b, prompt, cache_salt="tenant-b")
    assert usage.cached_prompt_tokens == 0 and out == reply
    out, usage = run(b, prompt, cache_salt="tenant-a")
    assert usage.remote_prompt_tokens == full_blocks(b, prompt) and out == reply
    assert_no_blocks_held(b)


def test_an_abort_while_fetching_leaks_nothing(replicas):
    a, b = replicas
    for i, delay in enumerate((0.0, 0.001, 0.005)):
        prompt = history(a, f"tea ceremonies {i}")
        computed_on_a(a, prompt)

        async def abandon(prompt=prompt, delay=delay):
            task = asyncio.ensure_future(generate(b, prompt))
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(abandon())
        assert_no_blocks_held(b)
        assert b.stats().num_loading == 0
    out, _ = run(b, history(b, "tea ceremonies 0"))  # and B serves on
    assert len(out) == GREEDY.max_new_tokens


def test_a_store_that_stops_mid_run_never_fails_a_request(replicas, store, caplog):
    a, b = replicas
    prompt = history(a, "sailing")
    reply = computed_on_a(a, prompt)

    async def while_the_store_dies():
        task = asyncio.ensure_future(generate(b, history(b, "rowing")))
        await asyncio.sleep(0.05)
        store.stop()
        return await task

    out, _ = asyncio.run(while_the_store_dies())
    assert len(out) == GREEDY.max_new_tokens
    out, usage = run(b, prompt)  # the store is gone: the history is computed, the reply the same
    assert out == reply and usage.remote_prompt_tokens == 0
    wait_for(lambda: not b.core.tiers.remote.up)
    out, usage = run(b, prompt)
    assert out == reply
    assert "does not answer" in caplog.text
    assert b.stats().remote.num_errors >= 1 and b.stats().remote.num_outages >= 1
    assert_no_blocks_held(b)
    store.start()  # restarted, empty: both replicas find it again and the fleet cache works as before
    wait_for(lambda: a.core.tiers.remote.up and b.core.tiers.remote.up, timeout=40)
    prompt = history(a, "kayaking")
    reply = computed_on_a(a, prompt)
    out, usage = run(b, prompt)
    assert out == reply and usage.remote_prompt_tokens == full_blocks(b, prompt)
    assert_no_blocks_held(b)


def test_a_store_that_never_answers_leaves_a_server_that_serves(smollm2_ir, tmp_path, caplog):
    engine = make_engine(smollm2_ir, None, "redis://127.0.0.1:1/0")
    try:
        out, usage = run(engine, history(engine, "chess"))
        assert len(out) == GREEDY.max_new_tokens and usage.remote_prompt_tokens == 0
        assert not engine.core.tiers.remote.up and "does not answer" in caplog.text
        assert_no_blocks_held(engine)
    finally:
        engine.shutdown()


def test_two_servers_share_a_conversation_over_the_http_api(smollm2_ir, store, tmp_path):
    """The whole path: two `python -m service` servers (in-process) with their own disks and one store; the same
    chat completion on the second, which never saw it, reports the history as fetched and gives the first's reply."""
    import openai

    from tests.support.servers import Running, base_config, free_port

    servers = [
        Running(
            base_config(
                smollm2_ir,
                kv_cache_gb=0.05,
                http_port=free_port(),
                kv_disk_dir=str(tmp_path / name),
                kv_remote_url=store.url,
            )
        )
        for name in ("a", "b")
    ]
    try:
        messages = conversation("river deltas")
        replies = []
        for running in servers:
            wait_for(lambda running=running: running.engine.core.tiers.remote.up)
            http = openai.OpenAI(base_url=f"{running.url}/v1", api_key="-", timeout=TIMEOUT)
            reply = http.chat.completions.create(
                model=http.models.list().data[0].id, messages=messages, max_tokens=16, temperature=0
            )
            if not replies:  # A's history reaches the store before B is asked
                counters = running.engine.core.tiers.remote.store.counters
                num_blocks = len(running.engine.tokenizer.encode_chat(messages)) // running.engine.info.block_size
                wait_for(lambda counters=counters, n=num_blocks: counters.num_published >= n)
            replies.append(reply)
        first, second = replies
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        details = second.usage.prompt_tokens_details
        assert details.cached_tokens == details.remote_tokens > 300 and details.disk_tokens == 0
        assert second.choices[0].message.content == first.choices[0].message.content
    finally:
        for running in servers:
            running.stop()


def test_a_conversation_alternating_between_two_replicas_finds_its_history_in_the_store(tiny_qwen3_ir, tmp_path):
    """Round robin in small form: two `python -m service` replicas sharing one store, a conversation's turns sent
    to each in turn, so that every returning turn lands on the replica that did not serve the turn before. The
    replica that never saw the conversation fetches its whole history from the store; back on the first, the
    part that replica computed itself is in its RAM and the part the other computed comes from the store."""
    store = RedisServer(tmp_path)
    replicas = start_replicas(tiny_qwen3_ir, 2, tmp_path, 1, 0.05, "--kv-remote-url", store.url)
    clients = [Client(r.target, timeout=TIMEOUT) for r in replicas]
    try:
        block_size = clients[0].model_info().block_size
        conversation = Conversation("alternating", None)
        keys_before = store.client().dbsize()
        for n in range(4):
            conversation.turn(clients[n % 2], max_new_tokens=16, timeout=TIMEOUT)
            # the turn's full blocks are in the store before the next turn goes to the other replica
            last = conversation.turns[-1]
            full_blocks = (last.prompt_tokens + last.completion_tokens - 1) // block_size
            wait_for(lambda need=full_blocks: store.client().dbsize() - keys_before >= need)
        first, second, third, fourth = conversation.turns
        assert first.history_tokens == 0 and first.remote_prompt_tokens == 0
        assert second.history_tokens > 250
        assert share_of_history([second], remote_only=True) >= 0.9  # the replica that never saw it
        for t in (third, fourth):
            assert 0 < t.remote_prompt_tokens < t.cached_prompt_tokens  # its own part from RAM, the rest fetched
        assert share_of_history(conversation.turns[1:]) >= 0.9
    finally:
        for client in clients:
            client.close()
        for r in replicas:
            r.stop()
        store.stop()
