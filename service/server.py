"""gRPC front end: thin servicers that translate proto <-> domain, one error table, health, auth, drain."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.api.ovserve.v1 import ovserve_pb2_grpc as pb_grpc
from service.config import ServerConfig
from service.core.outputs import FinishReason, RequestOutput
from service.core.params import SamplingParams
from service.engine import Engine, EngineConfig
from service.errors import DeadlineExceeded, InvalidArgument, QueueFull, ServiceError, Unavailable
from service.metrics import Metrics

log = logging.getLogger("service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# The one table from domain errors to status codes; anything else is INTERNAL.
STATUS_OF = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}
FINISH_REASON = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
AUTH_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def status_of(exc: BaseException) -> grpc.StatusCode:
    return next((code for kind, code in STATUS_OF.items() if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)


# -- proto -> domain -------------------------------------------------------------------------------------
def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults."""
    s, t = request.sampling, request.stopping
    fields = {
        name: getattr(s, name)
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "seed",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "logprobs",
        )
        if s.HasField(name)
    }
    fields |= {
        name: getattr(t, name)
        for name in ("max_new_tokens", "min_new_tokens", "include_stop_str_in_output", "ignore_eos")
        if t.HasField(name)
    }
    return SamplingParams(**fields, stop=tuple(t.stop), stop_token_ids=tuple(t.stop_token_ids))


def chat_messages(chat: pb.ChatInput) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def prompt_token_ids(engine: Engine, request: pb.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "chat":
        return engine.tokenizer.encode_chat(chat_messages(request.chat))
    if kind == "prompt":
        if not request.prompt:
            raise InvalidArgument("prompt", "must not be empty")
        return engine.tokenizer.encode(request.prompt)
    if kind == "tokens":
        if not request.tokens.ids:
            raise InvalidArgument("tokens.ids", "must not be empty")
        return list(request.tokens.ids)
    raise InvalidArgument("input", "set exactly one of chat, prompt or tokens")


# -- domain -> proto -------------------------------------------------------------------------------------
def _final_fields(out: RequestOutput) -> dict:
    if not out.finished:
        return {}
    fields: dict = {"finish_reason": FINISH_REASON.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)}
    if out.usage:
        fields["usage"] = pb.Usage(
            prompt_tokens=out.usage.prompt_tokens,
            completion_tokens=out.usage.completion_tokens,
            cached_prompt_tokens=out.usage.cached_prompt_tokens,
        )
    if out.timings:
        fields["timings"] = pb.Timings(
            queue_seconds=out.timings.queue,
            time_to_first_token_seconds=out.timings.ttft,
            total_seconds=out.timings.total,
        )
    return fields


def _logprobs(out: RequestOutput) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_token_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        for lp in out.logprobs
    ]


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def Generate(self, request, context):  # noqa: N802 (gRPC method names)
        text, tokens, logprobs, last = [], [], [], None
        async for out in self._run("Generate", request, context):
            text.append(out.text)
            tokens += out.token_ids
            logprobs += _logprobs(out)
            last = out
        if last is None:
            return pb.GenerateResponse()
        return pb.GenerateResponse(
            request_id=last.request_id, text="".join(text), token_ids=tokens, logprobs=logprobs, **_final_fields(last)
        )

    async def GenerateStream(self, request, context):  # noqa: N802
        async for out in self._run("GenerateStream", request, context):
            yield pb.GenerateStreamResponse(
                request_id=out.request_id,
                text_delta=out.text,
                token_ids=out.token_ids,
                logprobs=_logprobs(out),
                **_final_fields(out),
            )

    async def _run(self, rpc: str, request, context) -> AsyncIterator[RequestOutput]:
        state = self.state
        started = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        code = grpc.StatusCode.OK
        last_token_time = None
        try:
            engine = state.require_engine()
            ids = prompt_token_ids(engine, request)
            stream = engine.generate(ids, sampling_params(request), request_id, context.time_remaining())
            async for out in stream:
                now = time.monotonic()
                if out.token_ids and state.metrics:
                    if last_token_time is None:
                        state.metrics.ttft.observe(now - started)
                    else:
                        state.metrics.itl.observe(now - last_token_time)
                    last_token_time = now
                if out.finished and out.timings and state.metrics:
                    state.metrics.queue.observe(out.timings.queue)
                yield out
            log.info(
                "request %s done in %.3f s", request_id, time.monotonic() - started, extra={"request_id": request_id}
            )
        except asyncio.CancelledError:  # client cancel or deadline: the engine request was aborted on close
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code = status_of(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("request %s failed", request_id, extra={"request_id": request_id})
            await context.abort(code, str(exc) if isinstance(exc, ServiceError) else f"internal error: {exc}")
        finally:
            if state.metrics:
                state.metrics.requests.labels(rpc, code.name).inc()
                state.metrics.e2e.observe(time.monotonic() - started)

    async def Tokenize(self, request, context):  # noqa: N802
        try:
            engine = self.state.require_engine()
            if request.WhichOneof("input") == "chat":
                ids = engine.tokenizer.encode_chat(chat_messages(request.chat))
            elif request.text:
                ids = engine.tokenizer.encode(request.text)
            else:
                raise InvalidArgument("input", "set text or chat")
        except ServiceError as exc:
            await context.abort(status_of(exc), str(exc))
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context):  # noqa: N802
        try:
            info = self.state.require_engine().info
        except ServiceError as exc:
            await context.abort(status_of(exc), str(exc))
        return pb.ModelInfo(
            model_id=info.model_id,
            max_model_len=info.max_model_len,
            max_new_tokens_limit=info.max_new_tokens_limit,
            eos_token_ids=info.eos_token_ids,
            vocab_size=info.vocab_size,
            num_threads=info.num_threads,
            kv_cache_bytes=info.kv_cache_bytes,
            num_kv_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
        )


class BearerAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>`; health and reflection stay open so probes work."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(AUTH_EXEMPT_PREFIXES):
            return await continuation(details)
        if dict(details.invocation_metadata).get("authorization") == self._expected:
            return await continuation(details)
        return self._deny_stream if details.method.endswith("Stream") else self._deny


class ServerState:
    """Owns the server's lifecycle: loading -> serving -> draining."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.draining = False
        self.metrics: Metrics | None = None
        self.health = health.aio.HealthServicer()

    def require_engine(self) -> Engine:
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        if self.engine is None:
            raise Unavailable("the model is still loading")
        return self.engine

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state = ServerState()
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ]
        interceptors = []
        if config.auth_token_file:
            interceptors.append(BearerAuth(Path(config.auth_token_file).read_text().strip()))
        self.grpc = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.state), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.state.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        address = f"{config.host}:{config.port}"
        if config.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
            )
            self.port = self.grpc.add_secure_port(address, creds)
        else:
            self.port = self.grpc.add_insecure_port(address)

    async def start(self) -> None:
        """Start answering (health NOT_SERVING, generation UNAVAILABLE) before the model is loaded."""
        await self.state.set_serving(False)
        await self.grpc.start()
        log.info("listening on %s:%d", self.config.host, self.port)

    async def load(self, make_engine: Callable[[], Engine] | None = None) -> None:
        """Load and warm up the model off the event loop, then report SERVING."""
        engine = await asyncio.to_thread(make_engine or self._make_engine)
        await asyncio.to_thread(engine.start)
        self.state.engine = engine
        self.state.metrics = Metrics(engine)
        if self.config.metrics_port:
            self.state.metrics.serve(self.config.metrics_port, self.config.host)
        await self.state.set_serving(True)
        log.info(
            "serving %s (context %d tokens, %d threads)",
            engine.info.model_id,
            engine.info.max_model_len,
            engine.info.num_threads,
        )

    def _make_engine(self) -> Engine:
        c = self.config
        return Engine(
            c.model,
            EngineConfig(
                kv_cache_gb=c.kv_cache_gb,
                num_threads=c.threads,
                max_num_seqs=c.max_num_seqs,
                max_num_batched_tokens=c.max_num_batched_tokens,
                max_model_len=c.max_model_len,
                max_queue=c.max_queue,
                batch_window_ms=c.batch_window_ms,
                kv_cache_precision=c.kv_cache_precision,
            ),
        )

    async def drain(self) -> None:
        """Stop taking requests, let in-flight ones finish within the grace period, then stop."""
        state = self.state
        state.draining = True
        await state.set_serving(False)
        engine = state.engine
        if engine is not None:
            engine.stop_accepting()
            deadline = time.monotonic() + self.config.drain_grace_seconds
            while engine.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            log.info("drained; %d requests still in flight", engine.num_in_flight)
        await self.grpc.stop(grace=1.0)
        if engine is not None:
            engine.shutdown()
