"""Tenants on a real server (SmolLM2 int8): API keys from a keys file that is reloaded while serving, the tenant
in metrics and logs, each tenant's own prefix cache, fair admission and the per-tenant queue limit, through the
openai SDK and the gRPC client."""

import logging
import time

import grpc
import openai
import pytest

from service.client import Client
from tests.support.servers import TIMEOUT, Running, base_config, free_port, wait_idle

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"
CAROL = "carol-key-0123456789abcdef"
KEYS = f"# tenant key weight\nalice {ALICE}\nbob {BOB} 2\n"
# long enough for whole cached blocks (32 tokens each), the same words for every tenant
DOCUMENT = "Here is a long shared document about the history of the river and its bridges. " * 12
LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}, "temperature": 0}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "keys"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def server(smollm2_ir, keys_file):
    # two places and no queue beyond them per tenant: a third request of one tenant is refused
    config = base_config(
        smollm2_ir,
        http_port=free_port(),
        api_keys_file=str(keys_file),
        max_num_seqs=2,
        max_queued_per_tenant=0,
    )
    running = Running(config)
    yield running
    running.stop()


class sdk:  # noqa: N801 (reads as a function: the openai SDK with a tenant's key)
    def __init__(self, server: Running, key: str) -> None:
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)
        self.model = server.engine.info.model_id


def chat(client: sdk, text: str = "Say hello.", **kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    messages = [{"role": "user", "content": text}]
    return client.client.chat.completions.create(model=client.model, messages=messages, **kw)


def test_each_key_is_its_tenant_and_a_wrong_key_is_refused(server):
    assert chat(sdk(server, ALICE)).choices[0].message.content
    assert chat(sdk(server, BOB)).usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError) as refused:
        chat(sdk(server, "alice-key-0123456789abcdeX"))
    assert refused.value.body["code"] == "invalid_api_key"
    with Client(server.target, token=BOB, timeout=TIMEOUT) as client:
        assert client.generate(prompt="The capital of France is", max_new_tokens=2).usage.completion_tokens == 2
    with Client(server.target, token=CAROL, timeout=TIMEOUT) as client, pytest.raises(grpc.RpcError) as denied:
        client.generate(prompt="The capital of France is", max_new_tokens=2)
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_tenant_labels_metrics_and_log_lines(server, caplog):
    registry = server.server.metrics.registry

    def count(name, **labels):
        return registry.get_sample_value(name, labels) or 0.0

    http = {"endpoint": "chat.completions", "status": "200"}
    before = (
        count("ovserve_http_requests_total", **http, tenant="alice"),
        count("ovserve_requests_total", rpc="Generate", code="OK", tenant="bob"),
        count("ovserve_http_requests_total", **http, tenant="bob"),
    )
    first_tokens = count("ovserve_time_to_first_token_seconds_count", tenant="alice")
    caplog.set_level(logging.INFO, "service.call")
    chat(sdk(server, ALICE))
    with Client(server.target, token=BOB, timeout=TIMEOUT) as client:
        client.generate(prompt="Hi", max_new_tokens=2)
    assert count("ovserve_http_requests_total", **http, tenant="alice") == before[0] + 1
    assert count("ovserve_requests_total", rpc="Generate", code="OK", tenant="bob") == before[1] + 1
    assert count("ovserve_time_to_first_token_seconds_count", tenant="alice") == first_tokens + 1
    assert count("ovserve_http_requests_total", **http, tenant="bob") == before[2]  # bob came over gRPC only
    tenants = [getattr(r, "tenant", None) for r in caplog.records if r.name == "service.call"]
    assert tenants[-2:] == ["alice", "bob"]
    assert not any(ALICE in r.getMessage() or BOB in r.getMessage() for r in caplog.records)


def test_a_tenant_never_hits_anothers_cached_blocks(server):
    alice, bob = sdk(server, ALICE), sdk(server, BOB)
    chat(alice, DOCUMENT)
    again = chat(alice, DOCUMENT)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # alice's own blocks
    other = chat(bob, DOCUMENT)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # the same client salt does not join the two tenants' caches either
    salted = {"extra_body": {"cache_salt": "team"}}
    chat(alice, DOCUMENT, **salted)
    assert chat(alice, DOCUMENT, **salted).usage.prompt_tokens_details.cached_tokens >= 64
    assert chat(bob, DOCUMENT, **salted).usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as refused:
        chat(bob, DOCUMENT, extra_body={"cache_salt": "team\x00alice"})
    assert refused.value.body["param"] == "cache_salt"


def test_priority_is_checked_on_both_fronts(server):
    assert chat(sdk(server, ALICE), extra_body={"priority": -3}).usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as refused:
        chat(sdk(server, ALICE), extra_body={"priority": 5000})
    assert refused.value.body["param"] == "priority" and "[-1000, 1000]" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(sdk(server, ALICE), extra_body={"priority": "high"})
    assert refused.value.body["param"] == "priority"
    with Client(server.target, token=ALICE, timeout=TIMEOUT) as client:
        assert client.generate(prompt="Hi", max_new_tokens=2, priority=7).usage.completion_tokens == 2
        with pytest.raises(grpc.RpcError) as invalid:
            client.generate(prompt="Hi", max_new_tokens=2, priority=-1001)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority" in invalid.value.details()


def test_more_candidates_than_a_tenant_may_hold_is_invalid_not_a_full_queue(server):
    """Two places and no queue per tenant: n=3 could never be served, so retrying would not help."""
    with pytest.raises(openai.BadRequestError) as refused:
        chat(sdk(server, ALICE), n=3)
    assert refused.value.body["param"] == "n" and "--max-queued-per-tenant" in refused.value.body["message"]
    with Client(server.target, token=BOB, timeout=TIMEOUT) as client, pytest.raises(grpc.RpcError) as invalid:
        client.generate(prompt="Hi", max_new_tokens=2, n=3)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid.value.details().startswith("n: must be at most 2 here")
    assert len(chat(sdk(server, ALICE), n=2).choices) == 2


def test_a_flooding_tenant_is_refused_beyond_its_limit_while_another_is_served(server):
    alice = sdk(server, ALICE)
    streams = [chat(alice, f"Count to a thousand, take {i}.", stream=True, **LONG) for i in range(2)]
    try:
        for stream in streams:  # both have their first token: each holds one of the two places
            next(iter(stream))
        with pytest.raises(openai.RateLimitError) as refused:
            chat(alice)
        assert refused.value.body["code"] == "queue_full"
        assert "max_queued_per_tenant" in refused.value.body["message"]
        assert "tenant alice" in refused.value.body["message"]
        with Client(server.target, token=ALICE, timeout=TIMEOUT) as client, pytest.raises(grpc.RpcError) as full:
            client.generate(prompt="Hi", max_new_tokens=2)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # bob is served at once: his request takes a place from alice's, who holds more than her share
        started = time.monotonic()
        reply = chat(sdk(server, BOB), max_tokens=8)
        assert reply.usage.completion_tokens == 8 and time.monotonic() - started < 20
        assert server.engine.stats().num_preemptions >= 1
        for stream in streams:  # alice's requests go on, the preempted one recomputed
            assert any(chunk.choices and chunk.choices[0].delta.content for chunk in stream)
            break
    finally:
        for stream in streams:
            stream.close()
    wait_idle(server.engine)


def wait_for(check, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def accepted(server: Running, key: str) -> bool:
    try:
        chat(sdk(server, key), max_tokens=1)
    except openai.AuthenticationError:
        return False
    return True


def test_the_keys_file_is_reloaded_while_serving(server, keys_file, caplog):
    caplog.set_level(logging.WARNING, "service.serving.auth")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "service.serving.auth" and r.levelno >= 30]

    try:
        keys_file.write_text(f"carol {CAROL}\nbob {BOB} 2\n")
        assert wait_for(lambda: accepted(server, CAROL))
        assert not accepted(server, ALICE) and accepted(server, BOB)
        keys_file.write_text(f"carol {CAROL}\ncarol {CAROL} 3\n")  # a bad file: the keys stay as they were
        assert wait_for(lambda: warnings())
        assert accepted(server, CAROL) and accepted(server, BOB)
        assert len(warnings()) == 1 and "line 2: the same key as line 1" in warnings()[0]
        assert CAROL not in warnings()[0]
    finally:
        keys_file.write_text(KEYS)
        assert wait_for(lambda: accepted(server, ALICE))
