"""A scripted engine and tokenizer that satisfy the serving layer's contracts without a model, and an event
loop on its own thread to run a server around them."""

import asyncio
import threading

from service.core.outputs import FinishReason, RequestOutput, Timings, Usage
from service.engine import EngineStats, ModelInfo
from service.errors import InvalidArgument

TIMEOUT = 30
INFO = ModelInfo("fake", "/nowhere", 64, 64, 100, (2,), 1, 1024, 4, 16, 2, 64)


class FakeTokenizer:
    vocab_size = 100
    eos_token_ids = (2,)
    think_ids = None  # its template does not reason

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(65 + i % 26) for i in ids)

    def encode_chat(self, messages, tools=None, enable_thinking=None) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def apply_chat_template(self, messages) -> str:
        if not messages:
            raise InvalidArgument("messages", "must contain at least one message")
        for i, m in enumerate(messages):
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise InvalidArgument(f"messages[{i}].role", f"unknown role {m['role']!r}")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeEngine:
    """Emits one token per 10 ms; a prompt starting with token 99 makes generate() raise a plain bug."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.info = INFO
        self.started = threading.Event()
        self.release = threading.Event()
        self.live: set[str] = set()
        self.shut_down = False
        self.alive = True

    def on_death(self, listener) -> None:
        pass

    def start(self) -> None:
        self.release.wait(TIMEOUT)
        self.started.set()

    def shutdown(self) -> None:
        self.shut_down = True

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.live), num_total_blocks=4, num_free_blocks=4 - len(self.live))

    async def generate(self, asked):
        ids, params, request_id = asked.prompt_token_ids, asked.params, asked.request_id
        if ids[0] == 99:
            raise ZeroDivisionError("a bug")
        params.validate(INFO.max_new_tokens_limit, INFO.vocab_size)
        self.live.add(request_id)
        try:
            for i in range(params.max_new_tokens):
                await asyncio.sleep(0.01)
                last = i == params.max_new_tokens - 1
                yield RequestOutput(
                    request_id,
                    (i,),
                    self.tokenizer.decode([i]),
                    finish_reason=FinishReason.LENGTH if last else None,
                    usage=Usage(len(ids), i + 1, 0) if last else None,
                    timings=Timings(0.0, 0.01, 0.01 * i, 0.01 * (i + 1)) if last else None,
                )
        finally:
            self.live.discard(request_id)


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
