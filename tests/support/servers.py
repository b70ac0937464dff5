"""Servers for tests: a real Server in-process on its own event loop thread, `python -m service` (or a
variant) as a subprocess, free ports, a self-signed certificate and the gRPC health check."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.config import ServerConfig
from service.engine import EngineConfig
from service.process import Server
from tests.support.paths import ROOT

TIMEOUT = 60


class Running:
    """A Server on its own event loop thread, so tests can use the plain blocking client."""

    def __init__(self, config: ServerConfig, load: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(self._make(config))
        if load:
            self.call(self.server.load())
        self.target = f"127.0.0.1:{self.server.port}"

    async def _make(self, config: ServerConfig) -> Server:
        server = Server(config)
        await server.start()
        return server

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def engine(self):
        return self.server.engine

    @property
    def url(self) -> str:
        """The HTTP front's base URL (plain HTTP on 127.0.0.1)."""
        return f"http://127.0.0.1:{self.server.http.port}"

    drained = False

    def stop(self) -> None:
        if not self.drained:
            self.call(self.server.drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def base_config(model: Path, **kw) -> ServerConfig:
    """A server on a free port with a small KV cache; kw are fields of ServerConfig or EngineConfig."""
    engine_fields = {f.name for f in fields(EngineConfig)}
    defaults = {"kv_cache_gb": 0.05}
    engine = EngineConfig(**defaults | {k: v for k, v in kw.items() if k in engine_fields})
    # no drain delay: tests that drain see refusals at once (test_server's drain test covers the delay)
    server = {"port": 0, "metrics_port": 0, "http_port": 0, "drain_delay_seconds": 0.0}
    server |= {k: v for k, v in kw.items() if k not in engine_fields}
    return ServerConfig(model=str(model), engine=engine, **server)


def wait_idle(engine, timeout: float = 10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
            return s
        time.sleep(0.02)
    return engine.stats()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(target: str, service: str = "", credentials: grpc.ChannelCredentials | None = None) -> int:
    """The gRPC health check's answer, over TLS when credentials are given."""
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A key and a certificate for `localhost`, valid for a day."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


# gRPC on any free port; metrics and the HTTP API off
PORTS = ("--port", "0", "--metrics-port", "0", "--http-port", "0")


def start_process(module: str, model: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """`python -m module --model model` on a free port; returns once it serves, with its port."""
    env = {**os.environ, "OVSERVE_KV_CACHE_GB": "0.05", "OVSERVE_DRAIN_DELAY_SECONDS": "0"}
    command = [sys.executable, "-m", module, "--model", str(model), *PORTS, *args]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    port = None
    for line in proc.stderr:
        if "listening on" in line:
            port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
        if "serving" in line and port:
            return proc, port
    proc.kill()
    raise AssertionError(f"the server did not start (exit {proc.wait()})")
