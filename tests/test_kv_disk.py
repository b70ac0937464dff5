"""The disk tier of the prefix cache on a real model: a history computed, found in RAM, or restored from
disk (after eviction or a restart) gives the same greedy continuation; damaged files are recomputed;
tenants stay apart; no block is leaked."""

import asyncio
import random
import signal
import time

import pytest
from prometheus_client import generate_latest

from service.client import Client
from service.core.kv_cache import chain_digest, root_digest
from service.core.params import SamplingParams
from service.engine import Engine, EngineConfig, GenerationRequest
from service.metrics import Metrics
from tests.support.engine import assert_no_blocks_held
from tests.support.servers import TIMEOUT, start_process

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
# 26 blocks of 32 tokens for the tiny model (f16 blocks of 16 KiB, u8 ones of 10 KiB): a few prompts evict
# each other
RAM_GB = {"f16": 0.0004, "u8": 0.00025}


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 150_000) for _ in range(n)]


HISTORY = tokens(300, seed=1)
OTHERS = [tokens(400, seed=10 + i) for i in range(3)]  # together more than the RAM pool holds


def make_engine(model, disk_dir, precision="f16", **kw) -> Engine:
    config = EngineConfig(
        kv_cache_gb=RAM_GB[precision],
        kv_cache_precision=precision,
        inference_precision="f32",
        max_num_batched_tokens=64,
        kv_disk_dir=str(disk_dir) if disk_dir else None,
        **kw,
    )
    engine = Engine(model, config)
    engine.start()
    return engine


async def generate(engine: Engine, prompt, params=GREEDY, **kw):
    out, last = [], None
    async for chunk in engine.generate(GenerationRequest(prompt, params, **kw)):
        out += chunk.token_ids
        last = chunk
    return out, last.usage


def run(engine: Engine, prompt, **kw):
    return asyncio.run(generate(engine, prompt, **kw))


def wait_stored(engine: Engine, num_blocks: int) -> None:
    """The tier writes on its own thread: wait until it has stored num_blocks blocks."""
    deadline = time.monotonic() + 10
    while engine.core.tiers.disk.store.num_blocks < num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.core.tiers.disk.store.num_blocks >= num_blocks


def evict_from_ram(engine: Engine) -> None:
    wait_stored(engine, 9)  # the history's full blocks reached the disk before RAM forgets them
    for prompt in OTHERS:
        run(engine, prompt)
    assert not blocks_of(engine, HISTORY)


def blocks_of(engine: Engine, prompt) -> dict[bytes, bytes]:
    """The content of the prompt's leading blocks that the RAM cache holds, by digest (read while idle)."""
    kv, cache = engine.core.kv, engine.core.runner.cache_arrays()
    digest, found = root_digest(kv.identity, ""), {}
    for start in range(0, len(prompt) - kv.block_size + 1, kv.block_size):
        digest = chain_digest(digest, prompt[start : start + kv.block_size])
        block = kv.pool.lookup(digest)
        if block is None:
            break
        found[digest] = b"".join(a[block.block_id].tobytes() for a in cache)
    return found


@pytest.fixture(scope="module")
def computed(tiny_qwen3_fp16_ir):
    """The reference: the history's continuation on an engine without a disk tier."""
    engine = make_engine(tiny_qwen3_fp16_ir, None)
    try:
        return run(engine, HISTORY)[0]
    finally:
        engine.shutdown()


@pytest.fixture
def disk_engine(tiny_qwen3_fp16_ir, tmp_path):
    """An engine with a disk tier in tmp_path (f16 cache: exact comparisons)."""
    engine = make_engine(tiny_qwen3_fp16_ir, tmp_path)
    yield engine
    engine.shutdown()


def test_computed_ram_and_disk_give_the_same_continuation(disk_engine, computed):
    first, usage = run(disk_engine, HISTORY)
    assert first == computed and usage.cached_prompt_tokens == 0
    ram, usage = run(disk_engine, HISTORY)
    assert ram == computed and usage.cached_prompt_tokens == 288 and usage.disk_prompt_tokens == 0
    evict_from_ram(disk_engine)
    disk, usage = run(disk_engine, HISTORY)
    assert disk == computed
    assert usage.cached_prompt_tokens == usage.disk_prompt_tokens == 288  # every full block but the last token's
    s = disk_engine.stats()
    assert s.num_restored_prompt_tokens == 288 and s.disk.num_restores == 1 and s.disk.num_restored == 9
    assert s.disk.num_corrupt == 0 and s.disk.enabled
    metrics = Metrics()
    metrics.attach(disk_engine)
    text = generate_latest(metrics.registry).decode()
    assert 'ovserve_prompt_tokens_by_source_total{source="disk"} 288.0' in text
    assert 'ovserve_prompt_tokens_by_source_total{source="ram"} 288.0' in text
    assert "ovserve_kv_disk_restored_blocks_total 9.0" in text
    assert_no_blocks_held(disk_engine)


def history_then_stop(model, disk_dir) -> list[bytes]:
    """Run the history on an engine, stop it gracefully (which writes what was still queued), and return
    the digests of the history's blocks."""
    engine = make_engine(model, disk_dir)
    run(engine, HISTORY)
    digests = list(blocks_of(engine, HISTORY))
    engine.shutdown()
    return digests


def test_a_restart_finds_the_history_on_disk(tiny_qwen3_fp16_ir, tmp_path, computed):
    history_then_stop(tiny_qwen3_fp16_ir, tmp_path)
    engine = make_engine(tiny_qwen3_fp16_ir, tmp_path)
    try:
        assert engine.stats().disk.num_blocks > 0  # before any step: the tier's figures are there from the start
        out, usage = run(engine, HISTORY)
        assert out == computed and usage.disk_prompt_tokens == 288
        assert engine.stats().disk.num_written == 0  # nothing new: the restored blocks were already stored
        assert_no_blocks_held(engine)
    finally:
        engine.shutdown()


def test_damaged_files_are_recomputed_never_loaded(tiny_qwen3_fp16_ir, tmp_path, computed):
    digests = history_then_stop(tiny_qwen3_fp16_ir, tmp_path)
    assert len(digests) == len(list(tmp_path.rglob("*.kvb"))) == 9
    (fourth,) = tmp_path.rglob(digests[3].hex() + ".kvb")
    data = bytearray(fourth.read_bytes())
    data[-100] ^= 0xFF
    fourth.write_bytes(bytes(data))
    engine = make_engine(tiny_qwen3_fp16_ir, tmp_path)
    try:
        out, usage = run(engine, HISTORY)
        assert out == computed
        assert usage.disk_prompt_tokens == 3 * 32 and usage.cached_prompt_tokens == 3 * 32
        assert engine.stats().disk.num_corrupt == 1
        wait_stored(engine, 9)  # the recomputed block took the damaged file's place
        assert_no_blocks_held(engine)
    finally:
        engine.shutdown()


def test_two_requests_restoring_one_history_load_it_once(disk_engine, computed):
    run(disk_engine, HISTORY)
    evict_from_ram(disk_engine)

    async def both():
        return await asyncio.gather(generate(disk_engine, HISTORY), generate(disk_engine, HISTORY))

    (a, usage_a), (b, usage_b) = asyncio.run(both())
    assert a == b == computed
    assert sorted([usage_a.disk_prompt_tokens, usage_b.disk_prompt_tokens]) == [0, 288]
    assert usage_a.cached_prompt_tokens == usage_b.cached_prompt_tokens == 288
    assert disk_engine.stats().disk.num_restored == 9
    assert_no_blocks_held(disk_engine)


def test_a_cache_salt_keeps_tenants_apart_on_disk(disk_engine):
    run(disk_engine, HISTORY, cache_salt="tenant-a")
    evict_from_ram(disk_engine)
    _, usage = run(disk_engine, HISTORY, cache_salt="tenant-b")
    assert usage.cached_prompt_tokens == 0
    evict_from_ram(disk_engine)
    _, usage = run(disk_engine, HISTORY, cache_salt="tenant-a")
    assert usage.disk_prompt_tokens == 288
    assert_no_blocks_held(disk_engine)


def test_an_abort_while_restoring_leaks_nothing(disk_engine):
    """Cancelled at a few moments around the restore: before it starts, during it, just after it."""
    run(disk_engine, HISTORY)
    for delay in (0.0, 0.001, 0.005):
        evict_from_ram(disk_engine)

        async def abandon(delay=delay):
            task = asyncio.ensure_future(generate(disk_engine, HISTORY))
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(abandon())
        assert_no_blocks_held(disk_engine)
        assert disk_engine.stats().num_loading == 0
    out, _ = run(disk_engine, HISTORY)  # and the engine serves on
    assert len(out) == GREEDY.max_new_tokens


def test_an_unusable_folder_serves_without_the_tier(tiny_qwen3_fp16_ir, tmp_path, computed, caplog):
    (tmp_path / "file").write_text("")
    engine = make_engine(tiny_qwen3_fp16_ir, tmp_path / "file" / "kv")
    try:
        assert "kv disk tier off" in caplog.text
        out, _ = run(engine, HISTORY)
        assert out == computed and not engine.stats().disk.enabled
    finally:
        engine.shutdown()


def test_restored_u8_blocks_are_byte_identical(tiny_qwen3_ir, tmp_path):
    """With the default u8 cache, quantization makes outputs depend on how a block was filled, so this
    compares the blocks themselves: what the model wrote, and what the disk tier put back."""
    engine = make_engine(tiny_qwen3_ir, tmp_path, precision="u8")
    try:
        run(engine, HISTORY)
        written = blocks_of(engine, HISTORY)
        assert len(written) == 9
        evict_from_ram(engine)
        _, usage = run(engine, HISTORY)
        assert usage.disk_prompt_tokens == 288
        restored = blocks_of(engine, HISTORY)
        assert restored.keys() == written.keys()
        assert all(restored[d] == written[d] for d in written)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_server_restarted_with_sigterm_restores_from_disk(tiny_qwen3_fp16_ir, tmp_path):
    """The whole path: the gRPC server drains on SIGTERM (its queued writes reach the disk), a new process
    finds the blocks, and the reply says how many prompt tokens came from disk."""
    args = ("--kv-disk-dir", str(tmp_path), "--kv-cache-precision", "f16", "--inference-precision", "f32")
    request = {"prompt_token_ids": HISTORY, "max_new_tokens": 10, "ignore_eos": True, "timeout": TIMEOUT}
    replies = []
    for _ in range(2):
        proc, port = start_process("service", tiny_qwen3_fp16_ir, *args)
        try:
            with Client(f"127.0.0.1:{port}") as client:
                replies.append(client.generate(**request))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
    first, second = replies
    assert (first.usage.cached_prompt_tokens, first.usage.disk_prompt_tokens) == (0, 0)
    assert second.usage.cached_prompt_tokens == second.usage.disk_prompt_tokens == 288
    assert list(second.token_ids) == list(first.token_ids)


def test_a_planning_failure_after_a_load_started_leaks_nothing(disk_engine, computed, monkeypatch):
    from service.errors import EngineFailure

    run(disk_engine, HISTORY)
    evict_from_ram(disk_engine)
    scheduler = disk_engine.core.scheduler
    real_schedule = scheduler.schedule

    def schedule():
        plan = real_schedule()
        if plan.loads:  # the load was planned, but the plan never reaches the engine
            monkeypatch.undo()
            raise RuntimeError("injected planning failure")
        return plan

    monkeypatch.setattr(scheduler, "schedule", schedule)
    with pytest.raises(EngineFailure):
        run(disk_engine, HISTORY)
    assert_no_blocks_held(disk_engine)
    assert not scheduler.loading
    out, usage = run(disk_engine, HISTORY)  # nothing is left waiting for the lost load
    assert out == computed and usage.disk_prompt_tokens == 288
