"""Servers the benchmarks (and, through them, the tests) run on this machine's loopback: a free port, and Debian's
redis-server as the fleet cache's store, without persistence, in a folder of its own; stopped, killed and started
again on the same port where the store must fail."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

START_TIMEOUT_S = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_installed() -> bool:
    return shutil.which("redis-server") is not None


class RedisServer:
    def __init__(
        self,
        folder: Path,
        password: str | None = None,
        maxmemory: str | None = None,
        tls: tuple[Path, Path] | None = None,
        policy: str = "allkeys-lru",
    ) -> None:
        """tls: a key and a certificate for localhost; the server then speaks TLS only."""
        if not redis_installed():
            raise FileNotFoundError("redis-server is not installed (Debian package redis-server; make system-packages)")
        self.folder, self.password, self.maxmemory, self.tls, self.policy = folder, password, maxmemory, tls, policy
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"rediss://localhost:{self.port}/0" if self.tls else f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        if self.tls:
            ca = str(self.tls[1])
            return redis.Redis(
                "localhost", self.port, password=self.password, socket_timeout=5, ssl=True, ssl_ca_certs=ca
            )
        return redis.Redis("localhost", self.port, password=self.password, socket_timeout=5)

    def start(self) -> None:
        command = ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.tls:
            key, cert = self.tls
            command += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            command += ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert)]
        else:
            command += ["--port", str(self.port)]
        command += ["--dir", str(self.folder), "--logfile", str(self.folder / "redis.log")]
        if self.password:
            command += ["--requirepass", self.password]
        if self.maxmemory:
            command += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}: see {self.folder / 'redis.log'}")

    def stop(self) -> None:
        """Kill it (as a crash or a lost node would): its keys are gone."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def pause(self) -> None:
        """Stop it answering while its port stays open (a store that hangs: connections wait, replies never come)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def keys(self) -> list:
        return sorted(self.client().keys("*"))
