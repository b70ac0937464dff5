"""The gRPC front end: thin servicers that translate proto <-> domain (service/wire.py), one error table,
health, reflection, bearer auth, TLS and draining. The engine never sees protobuf; this module never sees
the model."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.auth import bearer_matches
from service.config import ServerConfig
from service.core.outputs import RequestOutput
from service.core.request import SESSION_KEY, check_label, session_key
from service.engine import Engine
from service.errors import DeadlineExceeded, EngineFailure, InvalidArgument, QueueFull, ServiceError, Unavailable
from service.http import HttpServer
from service.metrics import Metrics, TokenClock
from service.request_log import request_record
from service.wire import (
    SERVICE_NAME,
    generation_handler,
    model_info_pb,
    parsed,
    prompt_input,
    request_label,
    response_format,
    sampling_params,
    stream_response,
    tokenize_ids,
    tools,
    unary_response,
)

log = logging.getLogger("service.server")

HEALTH_EXEMPT_PREFIX = f"/{health.SERVICE_NAME}/"
# How long before its deadline a client cancel still counts as the deadline: the transit delay, generously.
DEADLINE_SLACK_SECONDS = 0.25

# The one table from domain errors to status codes. Anything else (EngineFailure included) is INTERNAL.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    EngineFailure: grpc.StatusCode.INTERNAL,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    for kind in type(exc).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.INTERNAL


def session_id(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The request's x-session-id, checked like request_id before it reaches a log line: the conversation it
    belongs to, which load balancers hash to send its turns to the replica holding its KV cache."""
    return session_key([value for key, value in metadata or () if key == SESSION_KEY])


def status_details(exc: BaseException) -> str:
    """Domain errors carry a message written for the client, cut to MAX_MESSAGE_CHARS (a message may quote what
    the client sent, and status details travel in gRPC metadata, which a client refuses beyond 8 KiB); anything
    else is not leaked in detail."""
    if isinstance(exc, ServiceError):
        return exc.client_message
    return f"internal error ({type(exc).__name__}); see the server log"


# -- servicers ---------------------------------------------------------------------------------------------
class ServerState:
    """Lifecycle shared by the servicers: loading (no engine) -> serving -> draining, or failed when the
    engine thread died."""

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
        if not self.engine.alive:
            raise Unavailable("the engine has stopped; retry on another replica")
        return self.engine

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


class GenerationServicer:
    """ovserve.v1.Generation. Requests arrive as parsed messages or as wire.Malformed (see generation_handler)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:  # noqa: N802
        outputs = [out async for out in self._generate("Generate", request, context)]
        return unary_response(outputs)

    async def GenerateStream(self, request: Any, context: grpc.aio.ServicerContext):  # noqa: N802
        async for out in self._generate("GenerateStream", request, context):
            yield stream_response(out)

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:  # noqa: N802
        async with _Rpc(self.state.metrics, "Tokenize", context):
            ids = await asyncio.to_thread(tokenize_ids, self.state.require_engine().tokenizer, parsed(request))
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelInfo:  # noqa: N802
        async with _Rpc(self.state.metrics, "GetModelInfo", context):
            parsed(request)
            info = self.state.require_engine().info
        return model_info_pb(info)

    async def _generate(
        self, rpc: str, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[RequestOutput]:
        """Runs one request on the engine. A client cancel or an expired deadline arrives as CancelledError
        while awaiting the engine; leaving the `async for` closes the engine's stream, which aborts the
        request and frees its KV blocks."""
        state = self.state
        started = time.monotonic()
        state.num_in_flight += 1
        try:
            async with _Rpc(state.metrics, rpc, context) as call:
                call.session_id = session_id(context.invocation_metadata())
                request = parsed(request)
                label = request_label(request)
                if label is not None:
                    check_label(label)  # before it is logged
                call.request_id = label = label or uuid.uuid4().hex
                engine = state.require_engine()
                # off the event loop, which serves every other call: a long prompt takes seconds to tokenize
                ids, field = await asyncio.to_thread(prompt_input, engine.tokenizer, request)
                params = sampling_params(request)
                structure, calls = response_format(request), tools(request)
                clock = TokenClock(state.metrics, started)
                stream = engine.generate(
                    ids,
                    params,
                    label,
                    context.time_remaining(),
                    prompt_field=field,
                    cache_salt=request.cache_salt,
                    response_format=structure,
                    tools=calls,
                )
                try:
                    async for out in stream:
                        clock.tick(out)
                        if out.finished:
                            call.output = out
                        yield out
                finally:
                    await stream.aclose()
        finally:
            state.num_in_flight -= 1


class _Rpc:
    """One RPC's bookkeeping: status code metric, a log line, and domain errors turned into statuses."""

    def __init__(self, metrics: Metrics, rpc: str, context: grpc.aio.ServicerContext) -> None:
        self.metrics, self.rpc, self.context = metrics, rpc, context
        self.request_id: str | None = None  # set once validated: only then may it reach the log
        self.session_id: str | None = None  # likewise
        self.started = time.monotonic()
        self.output: RequestOutput | None = None

    async def __aenter__(self) -> _Rpc:
        return self

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        seconds = time.monotonic() - self.started
        if exc is None:
            code = grpc.StatusCode.OK
        elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
            code = self._why_cancelled()  # the client went away or its deadline passed: re-raised below
        else:
            code = status_of(exc)
        self.metrics.observe_rpc(self.rpc, code.name, seconds, self.output)
        self._log(code, seconds, exc)
        if exc is None or isinstance(exc, asyncio.CancelledError | GeneratorExit):
            return False
        await self.context.abort(code, status_details(exc))  # raises: ends the RPC with this status
        return False

    def _why_cancelled(self) -> grpc.StatusCode:
        # The client's deadline passes first (the server's clock starts when the call arrives), and its cancel
        # can arrive before ours fires; a cancel that close to the deadline is the deadline.
        remaining = self.context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_SECONDS:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED

    def _log(self, code: grpc.StatusCode, seconds: float, exc: BaseException | None) -> None:
        if self.request_id is None and code is grpc.StatusCode.OK:
            return
        extra = request_record("grpc", self.rpc, code.name, seconds, self.request_id, self.session_id, self.output)
        if code is grpc.StatusCode.INTERNAL:
            log.error("request failed", extra=extra, exc_info=exc)
        elif exc is not None and code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            log.info("request refused: %s", status_details(exc), extra=extra)
        else:
            log.info("request done", extra=extra)


def check_key_pair(cert: str, key: str) -> None:
    """ValueError naming both files when the key is not the certificate's (gRPC would only fail to bind)."""
    try:
        # no password: gRPC takes an unencrypted key only, and OpenSSL would ask for one on the terminal
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--tls-cert {cert} and --tls-key {key} are not a certificate and its key: {exc}") from None


# -- auth --------------------------------------------------------------------------------------------------
def authorized(method: str, metadata: Iterable[tuple[str, str | bytes]] | None, token: str) -> bool:
    """Health checks are open so that probes work; everything else needs `authorization: Bearer <token>`."""
    if method.startswith(HEALTH_EXEMPT_PREFIX):
        return True
    for key, value in metadata or ():
        if key == "authorization":
            return bearer_matches(value if isinstance(value, bytes) else value.encode(), token.encode())
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
class Server:
    """A grpc.aio server around one engine. start() answers at once (health NOT_SERVING, generation
    UNAVAILABLE); attach() or load() make it SERVING; drain() takes it down gracefully."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine_failed = asyncio.Event()  # set when the engine thread died: the process must exit non-zero
        self.metrics = Metrics()
        self.state = ServerState(self.metrics)
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
        ]
        token = Path(config.auth_token_file).read_text().strip() if config.auth_token_file else None
        interceptors = [BearerAuth(token)] if token is not None else []
        self.grpc = grpc.aio.server(options=options, interceptors=interceptors)
        self.grpc.add_generic_rpc_handlers((generation_handler(GenerationServicer(self.state)),))
        health_pb2_grpc.add_HealthServicer_to_server(self.state.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        address = f"{config.host}:{config.port}"
        if config.tls_cert and config.tls_key:
            check_key_pair(config.tls_cert, config.tls_key)
            key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
            self.port = self.grpc.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.port = self.grpc.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot bind {address}")
        # The OpenAI-compatible HTTP API on the same loop, state and engine (service/http).
        self.http = HttpServer(config, self.state, token) if config.http_port else None

    @property
    def engine(self) -> Engine | None:
        return self.state.engine

    async def start(self) -> None:
        await self.state.set_serving(False)
        await self.grpc.start()
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port, self.config.host)
        log.info("listening on %s:%d%s", self.config.host, self.port, " (TLS)" if self.config.tls_cert else "")
        if self.http is not None:
            await self.http.start()
            log.info("HTTP API (OpenAI-compatible) at %sv1, playground at %s", self.http.url, self.http.url)

    async def attach(self, engine: Engine, started: bool = False) -> None:
        """Start (warm up) the engine off the event loop unless it already is, then report SERVING."""
        loop = asyncio.get_running_loop()

        def died() -> None:  # on the engine thread
            loop.call_soon_threadsafe(self._engine_died)

        engine.on_death(died)
        if not started:
            await asyncio.to_thread(engine.start)
        self.state.engine = engine
        self.metrics.attach(engine)
        if not engine.alive:
            raise RuntimeError("the engine stopped while starting")
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

    def _engine_died(self) -> None:
        """On the loop, at once: NOT_SERVING for probes and load balancers, and tell serve() to exit."""
        log.critical("the engine stopped; reporting NOT_SERVING")
        self.engine_failed.set()
        self._not_serving = asyncio.get_running_loop().create_task(self.state.set_serving(False))

    async def load(self) -> None:
        """Load the model named by the config (blocking work in a thread), then attach it."""
        engine = await asyncio.to_thread(Engine, self.config.model, self.config.engine)
        await self.attach(engine)

    async def drain(self, grace_seconds: float | None = None) -> None:
        """Refuse new requests (UNAVAILABLE), report NOT_SERVING, let in-flight requests finish within the
        grace period (default: the configured one), then stop the gRPC server and the engine."""
        state = self.state
        state.draining = True
        await state.health.enter_graceful_shutdown()
        grace = self.config.drain_grace_seconds if grace_seconds is None else grace_seconds
        deadline = time.monotonic() + grace
        while state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.num_in_flight:
            log.warning("drain grace period over; cancelling %d requests", state.num_in_flight)
        if self.http is not None:
            await self.http.stop()
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
