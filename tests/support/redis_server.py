"""A real redis-server for tests (bench.loopback's): a test that needs one is skipped where Debian's redis-server is
not installed."""

import pytest

from bench import loopback


class RedisServer(loopback.RedisServer):
    def __init__(self, *args, **kw) -> None:
        if not loopback.redis_installed():
            pytest.skip("redis-server is not installed (Debian package redis-server; `make system-packages`)")
        super().__init__(*args, **kw)
