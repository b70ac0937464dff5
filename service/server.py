"""The gRPC front end: thin servicers that translate proto <-> domain, one error table, health, reflection,
bearer auth, TLS and draining. The engine never sees protobuf; this module never sees the model."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.api.ovserve.v1 import ovserve_pb2_grpc as pb_grpc
from service.config import ServerConfig
from service.core.outputs import FinishReason, RequestOutput, Timings, TokenLogprob, Usage
from service.core.params import SamplingParams
from service.engine import Engine, EngineConfig, ModelInfo
from service.errors import DeadlineExceeded, EngineFailure, InvalidArgument, QueueFull, ServiceError, Unavailable
from service.metrics import Metrics
from service.wire import SAMPLING_FIELDS

log = logging.getLogger("service.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "ovserve.v1.Generation"
HEALTH_EXEMPT_PREFIX = f"/{health.SERVICE_NAME}/"

# The one table from domain errors to status codes. Anything else (EngineFailure included) is INTERNAL.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    EngineFailure: grpc.StatusCode.INTERNAL,
}

FINISH_REASON_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    for kind in type(exc).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.INTERNAL


def status_details(exc: BaseException) -> str:
    """Domain errors carry a message written for the client; anything else is not leaked in detail."""
    if isinstance(exc, ServiceError):
        return str(exc)
    return f"internal error ({type(exc).__name__}); see the server log"


# -- proto -> domain ---------------------------------------------------------------------------------------
def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; validation is the engine's."""
    fields = {name: getattr(request, name) for name in SAMPLING_FIELDS if request.HasField(name)}
    return SamplingParams(**fields, stop=tuple(request.stop), stop_token_ids=tuple(request.stop_token_ids))


def chat_messages(messages: Iterable[pb.ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def encode_chat(tokenizer, messages: Sequence[pb.ChatMessage]) -> list[int]:
    if not messages:
        raise InvalidArgument("messages", "must contain at least one message")
    return tokenizer.encode_chat(chat_messages(messages))


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if not prompt:
        raise InvalidArgument("prompt", "must not be empty")
    return tokenizer.encode(prompt)


def prompt_token_ids(tokenizer, request: pb.GenerateRequest) -> list[int]:
    """The request's one input, as token ids. Ranges of the ids and the prompt length are the engine's checks."""
    given = [
        name
        for name, present in (
            ("messages", len(request.messages) > 0),
            ("prompt", request.HasField("prompt")),
            ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        )
        if present
    ]
    if len(given) > 1:
        raise InvalidArgument("input", f"set exactly one of messages, prompt or prompt_token_ids, got {given}")
    if not given:
        raise InvalidArgument(
            "input", "set exactly one of messages, prompt or prompt_token_ids (messages and ids must be non-empty)"
        )
    if given[0] == "messages":
        return encode_chat(tokenizer, request.messages)
    if given[0] == "prompt":
        return encode_prompt(tokenizer, request.prompt)
    return list(request.prompt_token_ids)


def tokenize_ids(tokenizer, request: pb.TokenizeRequest) -> list[int]:
    if request.HasField("text") and request.messages:
        raise InvalidArgument("input", "set text or messages, not both")
    if request.messages:
        return encode_chat(tokenizer, request.messages)
    if request.HasField("text"):
        return encode_prompt(tokenizer, request.text)
    raise InvalidArgument("input", "set text or messages")


# -- domain -> proto ---------------------------------------------------------------------------------------
def usage_pb(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
    )


def timings_pb(t: Timings) -> pb.Timings:
    return pb.Timings(
        queue_seconds=t.queue, time_to_first_token_seconds=t.ttft, total_seconds=t.total, decode_seconds=t.decode
    )


def logprobs_pb(logprobs: Iterable[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_token_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        for lp in logprobs
    ]


def final_fields(out: RequestOutput) -> dict:
    """finish_reason, usage and timings of the last output; nothing for the others."""
    if out.finish_reason is None:
        return {}
    if out.finish_reason is FinishReason.ERROR:
        raise EngineFailure("the engine failed this request")
    fields: dict = {"finish_reason": FINISH_REASON_PB[out.finish_reason]}
    if out.usage is not None:
        fields["usage"] = usage_pb(out.usage)
    if out.timings is not None:
        fields["timings"] = timings_pb(out.timings)
    return fields


def stream_response(out: RequestOutput) -> pb.GenerateStreamResponse:
    return pb.GenerateStreamResponse(
        request_id=out.request_id,
        text=out.text,
        token_ids=out.token_ids,
        logprobs=logprobs_pb(out.logprobs),
        **final_fields(out),
    )


def unary_response(outputs: Sequence[RequestOutput]) -> pb.GenerateResponse:
    """All outputs of one request joined: the text and ids concatenated, the final fields from the last."""
    last = outputs[-1]
    return pb.GenerateResponse(
        request_id=last.request_id,
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
        logprobs=logprobs_pb(lp for o in outputs for lp in o.logprobs),
        **final_fields(last),
    )


def model_info_pb(info: ModelInfo) -> pb.ModelInfo:
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


# -- servicers ---------------------------------------------------------------------------------------------
class ServerState:
    """Lifecycle shared by the servicers: loading (no engine) -> serving -> draining."""

    def __init__(self, metrics: Metrics) -> None:
        self.engine: Engine | None = None
        self.draining = False
        self.num_in_flight = 0  # generation RPCs being answered
        self.metrics = metrics
        self.health = health.aio.HealthServicer()

    def require_engine(self) -> Engine:
        if self.draining:
            raise Unavailable("the server is draining; retry on another replica")
        if self.engine is None:
            raise Unavailable("the model is still loading; retry shortly")
        return self.engine

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def Generate(self, request, context):  # noqa: N802 (gRPC method names)
        outputs = [out async for out in self._generate("Generate", request, context)]
        return unary_response(outputs)

    async def GenerateStream(self, request, context):  # noqa: N802
        async for out in self._generate("GenerateStream", request, context):
            yield stream_response(out)

    async def Tokenize(self, request, context):  # noqa: N802
        async with self._rpc("Tokenize", context):
            ids = tokenize_ids(self.state.require_engine().tokenizer, request)
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context):  # noqa: N802
        async with self._rpc("GetModelInfo", context):
            info = self.state.require_engine().info
        return model_info_pb(info)

    def _rpc(self, rpc: str, context) -> _Rpc:
        return _Rpc(self.state.metrics, rpc, context)

    async def _generate(self, rpc: str, request, context) -> AsyncIterator[RequestOutput]:
        """Runs one request on the engine. A client cancel or an expired deadline arrives as CancelledError
        while awaiting the engine; leaving the `async for` closes the engine's stream, which aborts the
        request and frees its KV blocks."""
        state = self.state
        request_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        started = time.monotonic()
        state.num_in_flight += 1
        try:
            async with _Rpc(state.metrics, rpc, context, request_id) as call:
                engine = state.require_engine()
                ids = prompt_token_ids(engine.tokenizer, request)
                params = sampling_params(request)
                last_token = None
                stream = engine.generate(ids, params, request_id, context.time_remaining())
                try:
                    async for out in stream:
                        if out.token_ids:
                            now = time.monotonic()
                            state.metrics.observe_token(now - (last_token or started), first=last_token is None)
                            last_token = now
                        if out.finish_reason is FinishReason.ERROR:
                            raise EngineFailure("the engine failed this request")
                        if out.finished:
                            call.finished(out)
                        yield out
                finally:
                    await stream.aclose()
        finally:
            state.num_in_flight -= 1


class _Rpc:
    """One RPC's bookkeeping: status code metric, a log line, and domain errors turned into statuses."""

    def __init__(self, metrics: Metrics, rpc: str, context, request_id: str | None = None) -> None:
        self.metrics, self.rpc, self.context, self.request_id = metrics, rpc, context, request_id
        self.started = time.monotonic()
        self.output: RequestOutput | None = None

    def finished(self, out: RequestOutput) -> None:
        self.output = out

    async def __aenter__(self) -> _Rpc:
        return self

    async def __aexit__(self, kind, exc, tb) -> bool:
        seconds = time.monotonic() - self.started
        if exc is None:
            code = grpc.StatusCode.OK
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            code = grpc.StatusCode.CANCELLED  # the client went away or its deadline passed: re-raised below
        else:
            code = status_of(exc)
        self.metrics.observe_rpc(self.rpc, code.name, seconds, self.output)
        self._log(code, seconds, exc)
        if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            return False
        await self.context.abort(code, status_details(exc))  # raises: ends the RPC with this status
        return False

    def _log(self, code: grpc.StatusCode, seconds: float, exc: BaseException | None) -> None:
        if self.request_id is None and code is grpc.StatusCode.OK:
            return
        extra: dict = {"rpc": self.rpc, "code": code.name, "seconds": round(seconds, 4)}
        if self.request_id is not None:
            extra["request_id"] = self.request_id
        if self.output is not None and self.output.usage is not None:
            extra["prompt_tokens"] = self.output.usage.prompt_tokens
            extra["completion_tokens"] = self.output.usage.completion_tokens
            extra["cached_prompt_tokens"] = self.output.usage.cached_prompt_tokens
        if code is grpc.StatusCode.INTERNAL:
            log.error("request failed", extra=extra, exc_info=exc)
        elif exc is not None and code is not grpc.StatusCode.CANCELLED:
            log.info("request refused: %s", status_details(exc), extra=extra)
        else:
            log.info("request done", extra=extra)


# -- auth --------------------------------------------------------------------------------------------------
def authorized(method: str, metadata: Iterable[tuple[str, str | bytes]] | None, token: str) -> bool:
    """Health checks are open so that probes work; everything else needs `authorization: Bearer <token>`."""
    if method.startswith(HEALTH_EXEMPT_PREFIX):
        return True
    expected = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == "authorization":
            given = value if isinstance(value, bytes) else value.encode()
            return hmac.compare_digest(given, expected)
    return False


class BearerAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token file is empty")
        self._token = token

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if authorized(details.method, details.invocation_metadata, self._token):
            return await continuation(details)
        handler = await continuation(details)
        return self._deny_stream if handler is not None and handler.response_streaming else self._deny_unary


# -- the server --------------------------------------------------------------------------------------------
def engine_config(config: ServerConfig) -> EngineConfig:
    return EngineConfig(
        kv_cache_gb=config.kv_cache_gb,
        num_threads=config.threads,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        max_queue=config.max_queue,
        batch_window_ms=config.batch_window_ms,
        kv_cache_precision=config.kv_cache_precision,
        dynamic_quantization_group_size=config.dq_group_size,
        fast_single_stream=config.fast_single_stream,
        enable_prefix_caching=config.enable_prefix_caching,
    )


class Server:
    """A grpc.aio server around one engine. start() answers at once (health NOT_SERVING, generation
    UNAVAILABLE); attach() or load() make it SERVING; drain() takes it down gracefully."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.state = ServerState(self.metrics)
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [BearerAuth(Path(config.auth_token_file).read_text().strip())] if config.auth_token_file else []
        self.grpc = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.state), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.state.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        address = f"{config.host}:{config.port}"
        if config.tls_cert:
            key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
            self.port = self.grpc.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.port = self.grpc.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot bind {address}")

    @property
    def engine(self) -> Engine | None:
        return self.state.engine

    async def start(self) -> None:
        await self.state.set_serving(False)
        await self.grpc.start()
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port, self.config.host)
        log.info("listening on %s:%d%s", self.config.host, self.port, " (TLS)" if self.config.tls_cert else "")

    async def attach(self, engine: Engine, started: bool = False) -> None:
        """Start (warm up) the engine off the event loop unless it already is, then report SERVING."""
        if not started:
            await asyncio.to_thread(engine.start)
        self.state.engine = engine
        self.metrics.attach(engine)
        await self.state.set_serving(True)
        info = engine.info
        log.info(
            "serving %s: context %d tokens, %d threads, %d KV blocks of %d tokens",
            info.model_id,
            info.max_model_len,
            info.num_threads,
            info.num_kv_blocks,
            info.block_size,
        )

    async def load(self) -> None:
        """Load the model named by the config (blocking work in a thread), then attach it."""
        engine = await asyncio.to_thread(Engine, self.config.model, engine_config(self.config))
        await self.attach(engine)

    async def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE), report NOT_SERVING, let in-flight requests finish within the
        drain grace period, then stop the gRPC server and the engine."""
        state = self.state
        state.draining = True
        await state.health.enter_graceful_shutdown()
        deadline = time.monotonic() + self.config.drain_grace_seconds
        while state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.num_in_flight:
            log.warning("drain grace period over; cancelling %d requests", state.num_in_flight)
        await self.grpc.stop(grace=1.0)
        self.metrics.stop()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        log.info("stopped")


async def start_server(engine: Engine, config: ServerConfig, started: bool = False) -> tuple[Server, int]:
    """An in-process server around an engine, serving when this returns. Use port=0 for a free port."""
    server = Server(config)
    await server.start()
    await server.attach(engine, started)
    return server, server.port
