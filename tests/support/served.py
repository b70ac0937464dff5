"""Servers shared by the whole session, one per configuration that tests must have; each test leaves its
server idle (every block free) as it found it, and counts metrics as differences, never from zero.

- tiny_server: the tiny model uncompressed with an f16 KV cache (batched and lone requests give identical
  greedy text), 16 sequences, gRPC, HTTP and metrics ports. Most gRPC, HTTP, replica and playground tests.
- tools_server: the tiny model (int8) with the real Qwen3-4B-Instruct-2507 chat template (tools), gRPC and HTTP.
- smol_server: SmolLM2 without the prefix cache (a seeded request asked twice computes the same steps: a cached
  prefix leaves a shorter last step, whose int8 kernels may round a near tie differently), gRPC and HTTP.
- limits_server: one sequence and no queue, for RESOURCE_EXHAUSTED and 429.
- secure_server: a bearer token and TLS (a certificate for localhost) on both fronts.

Servers whose lifecycle is under test (loading, draining, a dead engine, SIGTERM) stay the tests' own."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import TEMPLATE
from tests.support.servers import Running, base_config, free_port, self_signed_cert


def _serve(model: Path, **kw) -> Iterator[Running]:
    running = Running(base_config(model, http_port=free_port(), metrics_port=free_port(), **kw))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_qwen3_fp16_ir) -> Iterator[Running]:
    yield from _serve(tiny_qwen3_fp16_ir, max_num_seqs=16, kv_cache_precision="f16")


@pytest.fixture(scope="session")
def tools_server(tiny_qwen3_ir) -> Iterator[Running]:
    yield from _serve(tiny_qwen3_ir, max_num_seqs=8, chat_template=str(TEMPLATE))


@pytest.fixture(scope="session")
def smol_server(smollm2_ir) -> Iterator[Running]:
    yield from _serve(smollm2_ir, max_num_seqs=8, enable_prefix_caching=False)


@pytest.fixture(scope="session")
def limits_server(tiny_qwen3_ir) -> Iterator[Running]:
    yield from _serve(tiny_qwen3_ir, max_num_seqs=1, max_queue=0)


@dataclass(frozen=True)
class Secure:
    running: Running
    token: str
    cert: Path

    @property
    def grpc_target(self) -> str:
        return f"localhost:{self.running.server.port}"

    @property
    def url(self) -> str:
        return f"https://localhost:{self.running.server.http.port}"


@pytest.fixture(scope="session")
def secure_server(tiny_qwen3_ir, tmp_path_factory) -> Iterator[Secure]:
    folder = tmp_path_factory.mktemp("secure")
    key, cert = self_signed_cert(folder)
    token = folder / "token"
    token.write_text("s3cret\n")
    options = {"host": "localhost", "auth_token_file": str(token), "tls_cert": str(cert), "tls_key": str(key)}
    for running in _serve(tiny_qwen3_ir, **options):
        yield Secure(running, "s3cret", cert)


SERVER_FIXTURES = frozenset({"tiny_server", "tools_server", "smol_server", "limits_server", "secure_server"})
