"""A real redis-server for tests: on a free port, in a temporary folder, without persistence; stopped, killed and
started again on the same port by the tests that need the store to fail."""

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.support.servers import free_port


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
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (Debian package redis-server; `make system-packages`)")
        self.folder, self.password, self.maxmemory, self.tls, self.policy = folder, password, maxmemory, tls, policy
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"rediss://localhost:{self.port}/0" if self.tls else f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": str(self.tls[1])} if self.tls else {}
        return redis.Redis(host="localhost", port=self.port, password=self.password, socket_timeout=5, **tls)

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
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise AssertionError("redis-server did not start")

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

    def keys(self) -> list[bytes]:
        return sorted(self.client().keys("*"))
