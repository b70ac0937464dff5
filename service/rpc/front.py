"""The gRPC front end: thin servicers that translate proto <-> domain (wire.py) over the serving layer, one
status table (status.py), health read from the serving state, reflection, bearer auth and TLS. The engine never
sees protobuf; this package never sees the model."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.config import ServerConfig
from service.core.outputs import RequestOutput, summary
from service.core.request import SESSION_KEY, Tenant, session_key
from service.errors import Unauthenticated
from service.metrics import Metrics, TokenClocks
from service.rpc.status import status_details, status_of
from service.rpc.wire import (
    SERVICE_NAME,
    generation_handler,
    generation_request,
    model_info_pb,
    parsed,
    request_label,
    stream_response,
    tokenize_ids,
    unary_response,
)
from service.serving.auth import Auth
from service.serving.call import Call
from service.serving.state import Serving

log = logging.getLogger("service.rpc")

HEALTH_EXEMPT_PREFIX = f"/{health.SERVICE_NAME}/"
HEALTH_NAMES = ("", SERVICE_NAME)
# How long before its deadline a client cancel still counts as the deadline: the transit delay, generously.
DEADLINE_SLACK_SECONDS = 0.25


def session_id(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The request's x-session-id, checked like request_id before it reaches a log line: the conversation it
    belongs to, which load balancers hash to send its turns to the replica holding its KV cache."""
    return session_key([value for key, value in metadata or () if key == SESSION_KEY])


# -- servicers ---------------------------------------------------------------------------------------------
class GenerationServicer:
    """ovserve.v1.Generation. Requests arrive as parsed messages or as wire.Malformed (see generation_handler)."""

    def __init__(self, serving: Serving, metrics: Metrics, auth: Auth) -> None:
        self.serving, self.metrics, self.auth = serving, metrics, auth

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:  # noqa: N802
        outputs = [out async for out in self._generate("Generate", request, context)]
        return unary_response(outputs)

    async def GenerateStream(self, request: Any, context: grpc.aio.ServicerContext):  # noqa: N802
        async for out in self._generate("GenerateStream", request, context):
            yield stream_response(out)

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:  # noqa: N802
        async with self.call("Tokenize", context):
            ids = await asyncio.to_thread(tokenize_ids, self.serving.require_engine().tokenizer, parsed(request))
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelInfo:  # noqa: N802
        async with self.call("GetModelInfo", context):
            parsed(request)
            info = self.serving.require_engine().info
        return model_info_pb(info)

    async def _generate(
        self, rpc: str, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[RequestOutput]:
        """Runs one request on the engine. A client cancel or an expired deadline arrives as CancelledError
        while awaiting the engine; leaving the `async for` closes the engine's stream, which aborts the
        request and frees its KV blocks."""
        async with self.call(rpc, context, generation=True) as call:
            call.session_id = session_id(context.invocation_metadata())
            request = parsed(request)
            label = call.label(request_label(request))
            engine = self.serving.require_engine()
            # off the event loop, which serves every other call: a long prompt takes seconds to tokenize
            asked = await asyncio.to_thread(
                generation_request, engine.tokenizer, request, label, context.time_remaining()
            )
            assert call.tenant is not None  # call() found it
            clocks = TokenClocks(self.metrics, call.started, call.tenant.name)
            stream = engine.generate(replace(asked, tenant=call.tenant))
            finals = []
            try:
                async for out in stream:
                    clocks.tick(out)
                    if out.finished:
                        finals.append(out)
                        call.output = summary(finals)
                    yield out
            finally:
                await stream.aclose()

    @asynccontextmanager
    async def call(self, rpc: str, context: grpc.aio.ServicerContext, generation: bool = False):
        """One RPC's Call; a domain error ends the RPC with its status, a cancel is counted and re-raised."""
        call = Call(self.serving, self.metrics, "grpc", rpc, generation)
        try:
            call.tenant = tenant_of(self.auth, context.invocation_metadata())
            yield call
        except (asyncio.CancelledError, GeneratorExit):
            call.finish(why_cancelled(context).name)  # the client went away or its deadline passed
            raise
        except Exception as exc:
            code = status_of(exc)
            call.finish(code.name, exc, failed=code is grpc.StatusCode.INTERNAL)
            await context.abort(code, status_details(exc))  # raises: ends the RPC with this status
        else:
            call.finish(grpc.StatusCode.OK.name)


def why_cancelled(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    # The client's deadline passes first (the server's clock starts when the call arrives), and its cancel
    # can arrive before ours fires; a cancel that close to the deadline is the deadline.
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_SECONDS:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


class Health(health.aio.HealthServicer):
    """grpc.health.v1 for the server ("") and ovserve.v1.Generation: Check reads the serving state when asked
    (so it agrees with HTTP /ready at every moment); Watch streams hear each change."""

    def __init__(self, serving: Serving) -> None:
        super().__init__()
        self.serving = serving
        self.updates: set[asyncio.Task[None]] = set()
        serving.on_change(self.changed)

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:  # noqa: N802
        if request.service not in HEALTH_NAMES:
            return await super().Check(request, context)
        return health_pb2.HealthCheckResponse(status=status(self.serving.ready))

    def changed(self, ready: bool) -> None:
        task = asyncio.get_running_loop().create_task(self.publish(ready))
        self.updates.add(task)
        task.add_done_callback(self.updates.discard)

    async def publish(self, ready: bool) -> None:
        for name in HEALTH_NAMES:
            await self.set(name, status(ready))


def status(serving: bool) -> Any:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


# -- auth --------------------------------------------------------------------------------------------------
def tenant_of(auth: Auth, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
    """The tenant whose key the call carries (`authorization: Bearer <key>`); Unauthenticated when none."""
    given = next((value for key, value in metadata or () if key == "authorization"), None)
    tenant = auth.tenant_of(given.encode() if isinstance(given, str) else given)
    if tenant is None:  # the interceptor let the call in, and a reload took its key away since
        raise Unauthenticated("missing or wrong bearer token")
    return tenant


def authorized(method: str, metadata: Iterable[tuple[str, str | bytes]] | None, auth: Auth) -> bool:
    """Health checks are open so that probes work; everything else needs `authorization: Bearer <key>`."""
    if method.startswith(HEALTH_EXEMPT_PREFIX):
        return True
    try:
        tenant_of(auth, metadata)
    except Unauthenticated:
        return False
    return True


class BearerAuth(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Auth) -> None:
        self._auth = auth

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if authorized(details.method, details.invocation_metadata, self._auth):
            return await continuation(details)
        handler = await continuation(details)
        return self._deny_stream if handler is not None and handler.response_streaming else self._deny_unary


def check_key_pair(cert: str, key: str) -> None:
    """ValueError naming both files when the key is not the certificate's (gRPC would only fail to bind)."""
    try:
        # no password: gRPC takes an unencrypted key only, and OpenSSL would ask for one on the terminal
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--tls-cert {cert} and --tls-key {key} are not a certificate and its key: {exc}") from None


# -- the server --------------------------------------------------------------------------------------------
class GrpcFront:
    """A grpc.aio server on --port, bound at construction (a taken port fails here; port 0 gets its number)."""

    def __init__(self, config: ServerConfig, serving: Serving, metrics: Metrics, auth: Auth) -> None:
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
            # a connection that has not finished its handshake in time, or that carries no call for a while, is
            # closed: silent connections cannot pile up (the HTTP front's limits, in gRPC's terms)
            ("grpc.server_handshake_timeout_ms", int(config.http_head_timeout_seconds * 1000)),
            ("grpc.max_connection_idle_ms", int(config.keep_alive_timeout_seconds * 1000)),
        ]
        interceptors = [BearerAuth(auth)] if auth.required else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.server.add_generic_rpc_handlers((generation_handler(GenerationServicer(serving, metrics, auth)),))
        self.health = Health(serving)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"{config.host}:{config.port}"
        if config.tls_cert and config.tls_key:
            check_key_pair(config.tls_cert, config.tls_key)
        try:
            if config.tls_cert and config.tls_key:
                key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
                self.port = self.server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc says only that it failed
            self.port = 0
        if not self.port:
            raise OSError("the address is in use or not available")

    async def start(self) -> None:
        await self.health.publish(False)
        await self.server.start()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace=grace)
