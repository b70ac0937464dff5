"""uvicorn serving the HTTP app on the process's event loop, beside the gRPC front: one process, one engine, no
thread between the two fronts."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import Iterator

import uvicorn

from service.config import ServerConfig
from service.http.app import build_app
from service.http.connections import Limits, with_limits
from service.metrics import Metrics
from service.serving.auth import Auth
from service.serving.state import Serving

SHUTDOWN_SECONDS = 1  # after the drain's grace: what is still streaming is cancelled after this


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # SIGTERM and SIGINT belong to `python -m service`, which drains both fronts; uvicorn must not take them.
        yield


def bind(host: str, port: int) -> socket.socket:
    """Bound and listening now, so that a taken port fails at construction and port 0 has its number."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family)


class HttpFront:
    """The OpenAI-compatible API and the playground on --http-port, over the process's serving state and
    metrics, with its bearer token, TLS certificate and body limit. Bound at construction."""

    def __init__(self, config: ServerConfig, serving: Serving, metrics: Metrics, auth: Auth) -> None:
        self.socket = bind(config.host, config.http_port)
        self.port: int = self.socket.getsockname()[1]
        self.scheme = "https" if config.tls_cert else "http"
        self.url = f"{self.scheme}://{config.host}:{self.port}/"
        app = build_app(serving, metrics, auth, config, self.socket.getsockname()[0])
        limits = Limits(config.http_head_timeout_seconds, config.http_body_timeout_seconds, config.http_max_connections)
        self.server = _Uvicorn(
            uvicorn.Config(
                app,
                http=with_limits(limits, metrics.observe_dropped_connection),
                timeout_keep_alive=math.ceil(config.keep_alive_timeout_seconds),
                ws="none",
                lifespan="off",
                log_config=None,
                # uvicorn's own warnings are about what clients send (a malformed request): not worth a line each
                log_level="error",
                access_log=False,
                server_header=False,
                ssl_certfile=config.tls_cert,
                ssl_keyfile=config.tls_key,
                timeout_graceful_shutdown=SHUTDOWN_SECONDS,
            )
        )
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Close the listening socket and idle connections, give open responses SHUTDOWN_SECONDS, then cancel
        them (a cancelled stream aborts its engine request)."""
        if self.task is None:
            self.socket.close()
            return
        self.server.should_exit = True
        await self.task
