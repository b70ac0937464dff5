"""python -m bench.genai_server --model DIR --port P: openvino-genai's ContinuousBatchingPipeline behind a
minimal OpenAI chat endpoint, so that bench.capacity drives it with the same HTTP client as the other servers.

What OpenVINO Model Server does with the same library, in far fewer lines: one thread runs the pipeline's
step loop (add_request, step, read each handle's new tokens), as OVMS's LLM calculator does; the HTTP side
renders the chat template and detokenizes with ovserve's tokenizer code (the same prompt tokens ovserve
computes). The scheduler keeps genai's defaults, OVMS's too (dynamic split-fuse, 256 tokens a step, 256
sequences), with prefix caching on (OVMS's default) and the KV budget bench.capacity gives every system.

Only what the benchmark sends is read: messages, max_tokens, temperature 0 (greedy), ignore_eos, stream;
every other field (`prediction` among them) is ignored, as the benchmark records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Push = Callable[[list[int], bool], None]


class Pipeline:
    """The pipeline and its step loop on a thread of its own; `submit` from any thread."""

    def __init__(self, model: str, kv_cache_gb: int, threads: int, precision: str | None) -> None:
        import openvino_genai as og

        from service.engine.model_files import ModelFiles

        sc = og.SchedulerConfig()
        sc.cache_size = kv_cache_gb
        sc.enable_prefix_caching = True
        properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads}
        if precision:
            properties["INFERENCE_PRECISION_HINT"] = precision
        self.og = og
        self.pipe = og.ContinuousBatchingPipeline(model, sc, "CPU", properties)
        self.eos = ModelFiles.read(model).eos_token_ids
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.ids = iter(range(1 << 62))
        threading.Thread(target=self.loop, daemon=True, name="genai-steps").start()

    def config(self, max_tokens: int, ignore_eos: bool) -> Any:
        config = self.og.GenerationConfig(max_new_tokens=max_tokens, ignore_eos=ignore_eos)
        config.eos_token_id = self.eos[0]
        config.stop_token_ids = set(self.eos)
        return config

    def submit(self, ids: list[int], config: Any, push: Push) -> None:
        self.pending.put((ids, config, push))
        self.wake.set()

    def loop(self) -> None:
        import numpy as np
        import openvino as ov

        live: dict[int, tuple[Any, Push]] = {}
        while True:
            while not self.pending.empty():
                ids, config, push = self.pending.get()
                handle = self.pipe.add_request(next(self.ids), ov.Tensor(np.asarray([ids], dtype=np.int64)), config)
                live[id(handle)] = (handle, push)
            if not live:
                self.wake.wait()
                self.wake.clear()
                continue
            self.pipe.step()
            for key, (handle, push) in list(live.items()):
                if handle.can_read():
                    for out in handle.read().values():
                        push(list(out.generated_ids), False)
                if handle.get_status() != self.og.GenerationStatus.RUNNING:
                    push([], True)
                    del live[key]


def app(pipeline: Pipeline, model: str):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from service.engine.model_files import ModelFiles
    from service.engine.tokenizer import Tokenizer

    tok = Tokenizer(ModelFiles.read(model).path)

    async def chat(request: Request):
        body = await request.json()
        ids = tok.encode_chat(body["messages"])
        config = pipeline.config(int(body.get("max_tokens") or 256), bool(body.get("ignore_eos")))
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()

        def push(new: list[int], done: bool) -> None:  # from the step loop's thread
            loop.call_soon_threadsafe(tokens.put_nowait, (new, done))

        pipeline.submit(ids, config, push)

        async def events():
            out: list[int] = []
            sent = ""
            created = int(time.time())

            def chunk(delta: dict, finish: str | None = None) -> str:
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                data = {"object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
                return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

            while True:
                new, done = await tokens.get()
                out += new
                text = tok.decode(out)
                if new and not text.endswith("\ufffd") and len(text) > len(sent):  # hold a split UTF-8 character
                    yield chunk({"content": text[len(sent) :]})
                    sent = text
                if done:
                    break
            yield chunk({}, "length" if len(out) >= config.max_new_tokens else "stop")
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
            yield f"data: {json.dumps({'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "genai"}]})

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health),
        Route("/v1/models", models),
    ]
    return Starlette(routes=routes)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m bench.genai_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kv-cache-gb", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", help="INFERENCE_PRECISION_HINT (default: the plugin's own)")
    a = p.parse_args(argv)
    pipeline = Pipeline(str(Path(a.model)), a.kv_cache_gb, a.threads, a.precision)
    print("genai_server: serving", flush=True)
    uvicorn.run(app(pipeline, a.model), host="127.0.0.1", port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
