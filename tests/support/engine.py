"""Driving an Engine directly: random prompts, collecting a request's replies, waiting for every block back."""

import asyncio
import random

from service.core.params import SamplingParams
from service.engine import Engine, GenerationRequest

NEW = 12
PRECISION = "f16"  # exact comparisons: a u8 cache rounds the small differences between a chunk and one-token steps
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 150_000) for _ in range(rng.randint(3, 150))] for _ in range(n)]


async def collect(engine: Engine, prompt, params=GREEDY, delay: float = 0.0, **kw):
    await asyncio.sleep(delay)
    tokens, text, last = [], "", None
    async for out in engine.generate(GenerationRequest(prompt, params, **kw)):
        tokens += out.token_ids
        text += out.text
        last = out
    return tokens, text, last


def run(coro):
    return asyncio.run(coro)


def assert_no_blocks_held(engine: Engine):
    async def settle():
        for _ in range(100):
            s = engine.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
                return s
            await asyncio.sleep(0.02)
        return engine.stats()

    s = run(settle())
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks)
