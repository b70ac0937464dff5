"""The OpenAI-compatible HTTP front on a real server (gRPC and HTTP on one engine), driven by the official
`openai` package, httpx, a raw socket (to vanish mid-request) and the README's own curl commands."""

import asyncio
import json
import logging
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import Client
from tests.support.paths import ROOT
from tests.support.servers import TIMEOUT, Running, base_config, free_port, health_status, wait_idle

LONG = {"max_tokens": 3000, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def openai_client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def sdk(server):
    with openai_client(server) as client:
        yield client


@pytest.fixture(scope="module")
def model(server):
    return server.engine.info.model_id


def chat(sdk, model, text="Say something.", **kw):
    return sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **kw)


GREEDY = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_chat_unary_and_stream_agree(sdk, model):
    whole = chat(sdk, model, **GREEDY)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    assert whole.usage.completion_tokens_details.accepted_prediction_tokens == 0  # no speculation here
    chunks = list(chat(sdk, model, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    *_, last_choice, usage = chunks
    assert last_choice.choices[0].finish_reason == "length" and last_choice.choices[0].delta.content is None
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_unary_stream_and_token_ids(sdk, model, server):
    whole = sdk.completions.create(model=model, prompt="Once upon a time", **GREEDY)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    streamed = list(sdk.completions.create(model=model, prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    ids = server.engine.tokenizer.encode("Once upon a time")
    by_ids = sdk.completions.create(model=model, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == whole.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_grpc_and_http_share_one_engine(sdk, model, server):
    """Same greedy text through both fronts, and a prompt computed for gRPC is a prefix-cache hit over HTTP."""
    prompt = "A shared engine serves both fronts. " * 12
    with Client(f"127.0.0.1:{server.server.port}", timeout=TIMEOUT) as grpc_client:
        grpc_reply = grpc_client.generate(prompt=prompt, max_new_tokens=12, ignore_eos=True)
    http_reply = sdk.completions.create(model=model, prompt=prompt, **GREEDY)
    assert http_reply.choices[0].text == grpc_reply.text
    cached = http_reply.usage.prompt_tokens_details.cached_tokens
    assert cached >= server.engine.info.block_size and grpc_reply.usage.cached_prompt_tokens < cached


def test_stop_strings(sdk, model):
    text = chat(sdk, model, **GREEDY).choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    cut = chat(sdk, model, stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible(sdk, model):
    def sample(seed):
        return chat(sdk, model, seed=seed, **(GREEDY | {"temperature": 1.0})).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_logprobs(sdk, model):
    reply = chat(sdk, model, logprobs=True, top_logprobs=3, **GREEDY).choices[0]
    entries = reply.logprobs.content
    assert len(entries) == 12 and "".join(e.token for e in entries) == reply.message.content
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[2].logprob for e in entries)
    assert all(e.logprob <= 0 and bytes(e.bytes).decode() == e.token for e in entries)
    plain = chat(sdk, model, logprobs=True, **GREEDY).choices[0].logprobs.content
    assert [e.top_logprobs for e in plain] == [[]] * 12 and [e.token for e in plain] == [e.token for e in entries]
    text = sdk.completions.create(model=model, prompt="Hello", logprobs=2, **GREEDY).choices[0]
    assert len(text.logprobs.tokens) == 12 and all(len(t) <= 2 for t in text.logprobs.top_logprobs)
    assert text.logprobs.text_offset[0] == 0 and "".join(text.logprobs.tokens) == text.text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"max_completion_tokens": 5, "max_tokens": "x"}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"n": 2**63}, "n"),  # nothing is sized by n before it is checked (a list of 2**63 was a 500)
        ({"n": 10**10, "stream": True}, "n"),
        ({"n": "3"}, "n"),
        ({"n": 1.5}, "n"),
        ({"extra_body": {"best_of": 2}}, "best_of"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 1}}},
            "response_format.json_schema.schema",
        ),
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias.1.5"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias.5"),
        ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
        ({"logit_bias": {"5": True}}, "logit_bias.5"),
        ({"logit_bias": {"5": 10**30}}, "logit_bias.5"),
        ({"logit_bias": {"1000000000": 1}}, "logit_bias.1000000000"),
        ({"logit_bias": {"-1": 1}}, "logit_bias.-1"),
        ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias.05"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"seed": -1}, "seed"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"extra_body": {"min_tokens": 99}, "max_tokens": 5}, "min_tokens"),
        ({"extra_body": {"top_k": "5"}}, "top_k"),
        ({"extra_body": {"speculation": "always"}}, "speculation"),
        ({"extra_body": {"speculation": True}}, "speculation"),
    ],
)
def test_invalid_fields_are_bad_requests_naming_the_field(sdk, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(sdk, model, **kwargs)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["message"].startswith(param)


def test_unsupported_content_and_unknown_model(sdk, model, server):
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": image}])
    assert err.value.body["param"] == "messages[0].content[0].type"
    with pytest.raises(openai.NotFoundError) as err:
        chat(sdk, "gpt-4o")
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4o")
    assert sdk.models.retrieve(model).id == model and [m.id for m in sdk.models.list()] == [model]
    n = server.engine.info.max_model_len
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=model, prompt=[5] * (n + 3))
    assert err.value.body["param"] == "prompt" and str(n + 3) in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # too long by itself: the prompt, not max_tokens, is named
        sdk.completions.create(model=model, prompt=[5] * (n + 3), max_tokens=4)
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:  # fits, but not with what is asked for
        sdk.completions.create(model=model, prompt=[5] * (n - 2), max_tokens=4)
    assert err.value.body["param"] == "max_tokens" and "at most 2 new tokens" in err.value.body["message"]


@pytest.mark.parametrize(
    ("body", "headers", "status", "param"),
    [
        (b"{not json", {}, 400, "body"),
        (b"[1, 2]", {}, 400, "body"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', {}, 400, "body"),
        (b"[" * 100_000 + b"]" * 100_000, {}, 400, "body"),
        (b"\xff\xfe\x00garbage", {}, 400, "body"),
        (b'{"messages": "hi"}', {}, 400, "messages"),
        (b'{"messages": [{"role": "assistant", "tool_calls": {}}]}', {}, 400, "messages[0].tool_calls"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": true}', {}, 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}', {}, 400, "max_tokens"),
        (b'{"messages": [{"role": "hacker", "content": "hi"}]}', {}, 400, "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', {"X-Request-Id": "a\tb <script>"}, 400, "X-Request-Id"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', {"X-Request-Id": "x" * 129}, 400, "X-Request-Id"),
        (b"{" + b" " * (5 << 20) + b"}", {}, 413, None),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', {"X-Session-Id": "a b <script>"}, 400, "x-session-id"),
    ],
)
def test_hostile_bodies_get_clear_client_errors(server, sdk, model, body, headers, status, param):
    reply = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers, timeout=TIMEOUT)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] and error["code"]
    if "X-Request-Id" in headers:
        assert "X-Request-Id" not in reply.headers  # an invalid id is not echoed
    assert chat(sdk, model, max_tokens=2).usage.completion_tokens == 2  # the server goes on


def test_a_tiny_temperature_or_penalty_answers_and_leaves_other_requests_alone(sdk, model):
    # logits divided by 1e-300 overflowed and made the probabilities NaN: the step failed, and with it every
    # request that shared it
    greedy = chat(sdk, model, **GREEDY).choices[0].message.content
    tiny_penalty = {"ignore_eos": True, "repetition_penalty": 1e-300}
    with ThreadPoolExecutor(3) as pool:
        beside = pool.submit(chat, sdk, model, **GREEDY)
        tiny = [
            pool.submit(chat, sdk, model, **GREEDY | {"temperature": 1e-300}),
            pool.submit(chat, sdk, model, **GREEDY | {"temperature": 1.0, "extra_body": tiny_penalty}),
        ]
        assert beside.result().choices[0].message.content == greedy
        assert tiny[0].result().choices[0].message.content == greedy  # the top token every time
        assert tiny[1].result().usage.completion_tokens == 12


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
        ("completions", {"prompt": "a\udfffb"}, "prompt"),
        ("completions", {"prompt": "hi", "stop": ["ok", "\ud800"]}, "stop[1]"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "x\ud800": 1}, "body"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "\ud800"}},
            "structured_outputs.regex",
        ),
    ],
)
def test_lone_surrogates_are_bad_requests_naming_the_field(server, sdk, model, path, body, param):
    # json.loads turns "\ud800" into a str that no tokenizer or encoder takes: it was a 500
    text = json.dumps(body)  # ASCII: the surrogates go as \u escapes, as a client's JSON writer sends them
    reply = httpx.post(f"{server.url}/v1/{path}", content=text, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]
    assert chat(sdk, model, max_tokens=2).usage.completion_tokens == 2


def test_nesting_is_refused_where_it_goes_too_deep(server, sdk, model):
    # nested just below the parser's limit, a body failed later, where it was serialized again (RecursionError)
    deep = json.loads("[" * 900 + "]" * 900)
    schema = {"type": "object", "properties": {"a": deep}}
    body = {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"json": schema}}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith("structured_outputs.json.properties.a[0][0]") and "64 levels" in error["message"]
    arguments = json.dumps({"a": deep})  # a tool call's arguments are JSON text inside the body
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, timeout=TIMEOUT)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith("messages[1].tool_calls[0].function.arguments.a[0]")
    assert chat(sdk, model, max_tokens=2).usage.completion_tokens == 2


def test_request_ids_in_and_out(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    given = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert given.headers["X-Request-Id"] == "trace-42" and given.json()["id"] == "chatcmpl-trace-42"
    made = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["X-Request-Id"])
    assert made.json()["id"] == "chatcmpl-" + made.headers["X-Request-Id"]


def running_count(engine, count: int) -> bool:
    deadline = time.time() + 10  # the stats snapshot is published just after the step's tokens are sent
    while engine.stats().num_running != count and time.time() < deadline:
        time.sleep(0.01)
    return engine.stats().num_running == count


def test_a_stream_closed_by_the_client_frees_its_blocks(sdk, model, server):
    stream = chat(sdk, model, stream=True, **LONG)
    next(iter(stream))
    assert running_count(server.engine, 1)
    stream.close()
    s = wait_idle(server.engine)
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks)


def test_a_client_gone_before_a_unary_reply_frees_its_blocks(server):
    body = json.dumps({"prompt": "Tell a long story.", "max_tokens": 3000, "ignore_eos": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.server.http.port)) as conn:
        conn.sendall(head + body)
        assert running_count(server.engine, 1)
    s = wait_idle(server.engine)
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks)


def test_a_full_queue_is_429(limits_server):
    server = limits_server  # no queue: the requests beyond max_num_seqs are refused
    with openai_client(server) as sdk:
        model = server.engine.info.model_id
        streams = [chat(sdk, model, stream=True, **LONG) for _ in range(server.engine.config.max_num_seqs)]
        try:
            with pytest.raises(openai.RateLimitError) as err:
                chat(sdk, model, max_tokens=2)
            assert err.value.body["code"] == "queue_full"
        finally:
            for stream in streams:
                stream.close()
    wait_idle(server.engine)


def test_metrics_and_logs_say_http(sdk, model, server, caplog):
    registry = server.server.metrics.registry

    def count(endpoint, status):
        labels = {"endpoint": endpoint, "status": status, "tenant": "default"}
        return registry.get_sample_value("ovserve_http_requests_total", labels) or 0.0

    before = count("chat.completions", "200"), count("chat.completions", "400")
    with caplog.at_level(logging.INFO, logger="service.call"):
        chat(sdk, model, max_tokens=2, extra_headers={"X-Request-Id": "logged-1", "X-Session-Id": "chat-7"})
        with pytest.raises(openai.BadRequestError):
            chat(sdk, model, temperature=-1)
    assert (count("chat.completions", "200"), count("chat.completions", "400")) == (before[0] + 1, before[1] + 1)
    done = [r for r in caplog.records if getattr(r, "request_id", None) == "logged-1"]
    assert len(done) == 1 and done[0].protocol == "http" and done[0].rpc == "chat.completions"
    assert done[0].code == 200 and done[0].completion_tokens == 2 and done[0].session_id == "chat-7"


def test_playground_and_probes_are_served(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "default-src 'self'" in page.headers["Content-Security-Policy"]
    assert 'src="static/playground.js"' in page.text and "http" not in page.text.split("<body>")[1]
    script = httpx.get(server.url + "/static/playground.js")
    assert script.headers["content-type"].startswith("text/javascript")
    for response in (page, script):  # no other site may frame the page or its files
        assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]
        assert response.headers["X-Frame-Options"] == "DENY" and response.headers["X-Content-Type-Options"] == "nosniff"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json() == {"status": "ready"}
    assert httpx.get(server.url + "/nowhere").json()["error"]["code"] == "not_found"


def test_pages_of_other_origins_cannot_make_the_server_generate(server):
    # a page anywhere could POST text/plain (no preflight) to a server on its visitor's machine, which generated
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    host = server.url.removeprefix("http://")
    plain = {"content-type": "text/plain"}
    for origin in ("http://evil.example", "null", f"http://{host}.evil.example"):
        reply = httpx.post(server.url + "/v1/chat/completions", content=body, headers=plain | {"origin": origin})
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "cross_origin", reply.text
    own = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"origin": f"http://{host}"})
    proxied = httpx.post(
        server.url + "/v1/chat/completions",
        content=body,
        headers={"origin": "https://chat.example.com", "x-forwarded-host": "chat.example.com, lb.internal"},
    )
    bare = httpx.post(server.url + "/v1/chat/completions", content=body)  # curl, SDKs: no Origin
    assert [r.status_code for r in (own, proxied, bare)] == [200, 200, 200]


def test_a_page_that_points_its_name_at_the_server_is_refused(server):
    # DNS rebinding: the page's name now resolves to 127.0.0.1, so its Origin and the Host header agree and the
    # Origin check let it generate and read the reply; the Host header still carries the page's name
    port = server.server.http.port
    registry = server.server.metrics.registry
    host_refused = {"endpoint": "any", "status": "403", "tenant": ""}  # refused before any tenant is known
    refused = registry.get_sample_value("ovserve_http_requests_total", host_refused) or 0.0
    rebound = {"host": f"evil.example:{port}", "origin": f"http://evil.example:{port}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/")):
        reply = httpx.request(method, server.url + path, json=body if method == "POST" else None, headers=rebound)
        assert reply.status_code == 403, reply.text
        error = reply.json()["error"]
        assert error["code"] == "host_not_allowed" and "evil.example" in error["message"]
    assert registry.get_sample_value("ovserve_http_requests_total", host_refused) == refused + 3
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        own = {"host": host, "origin": f"http://{host}"}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, headers=own).status_code == 200


def test_allowed_origins_let_named_pages_in():
    from starlette.requests import Request

    from service.http.app import refuse_other_origins
    from service.http.errors import CrossOrigin

    def request(origin):
        return Request({"type": "http", "headers": [(b"origin", origin.encode()), (b"host", b"127.0.0.1:8000")]})

    refuse_other_origins(request("https://app.example.com"), {"https://app.example.com"})
    refuse_other_origins(request("https://anything.example"), {"*"})
    refuse_other_origins(request("http://127.0.0.1:8000"), set())  # the server's own page
    with pytest.raises(CrossOrigin):
        refuse_other_origins(request("https://app.example.com.evil"), {"https://app.example.com"})


def test_readme_curl_examples_run(server, model):
    """The README's HTTP examples, pointed at this server: every curl command must succeed."""
    readme = (ROOT / "README.md").read_text()
    section = re.split(r"\n#{2,3} ", readme.split("### HTTP API", 1)[1], maxsplit=1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    commands = [b for b in blocks if "curl" in b]
    assert commands, "no curl example in the README's HTTP API section"
    for block in commands:
        script = block.replace("localhost:8000", f"127.0.0.1:{server.server.http.port}")
        result = subprocess.run(["bash", "-eo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        # an error object's key, not the word: generated text may contain "error", but inside a JSON string
        # its quotes are escaped, so only a real key matches
        assert not re.search(r'"error"\s*:', result.stdout), result.stdout
        assert result.stdout.strip()
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    assert python and "base_url" in python[0]
    script = python[0].replace("localhost:8000", f"127.0.0.1:{server.server.http.port}")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr


# -- auth and TLS (a shared server); loading and draining (a server of its own) ---------------------------
def test_auth_and_tls(secure_server):
    url, cert = secure_server.url, secure_server.cert
    with httpx.Client(verify=str(cert), timeout=TIMEOUT) as http:
        # the SDK would close a client it is given when used as a context manager
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.models.list()
        assert err.value.body["code"] == "invalid_api_key"
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=secure_server.token, http_client=http, max_retries=0)
        model = sdk.models.list().data[0].id
        assert chat(sdk, model, max_tokens=2).usage.completion_tokens == 2
        assert http.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401  # no header
        for probe in ("/health", "/ready", "/"):
            assert http.get(url + probe).status_code == 200  # probes and the page need no token
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https:", "http:") + "/health", timeout=5)  # TLS only


def test_both_fronts_load_serve_and_drain_together(tiny_qwen3_ir):
    """Readiness is decided once: gRPC health and HTTP /ready agree while loading (NOT_SERVING, 503, requests
    refused as UNAVAILABLE and 503), once loaded, and while draining: not ready at once, new requests still
    served for the drain delay, then refused, while the streams in flight on both fronts finish."""
    port = free_port()
    running = Running(base_config(tiny_qwen3_ir, http_port=port, drain_grace_seconds=30), load=False)
    url = f"http://127.0.0.1:{port}"
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        assert health_status(running.target) == not_serving
        with Client(running.target) as c, pytest.raises(grpc.RpcError) as err:
            c.generate(prompt="hi", timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/ready").status_code == 503
        with pytest.raises(openai.InternalServerError) as err:
            chat(sdk, "any")
        assert err.value.status_code == 503 and "loading" in err.value.body["message"]

        running.call(running.server.load())
        assert health_status(running.target) == serving
        assert health_status(running.target, "ovserve.v1.Generation") == serving
        assert httpx.get(url + "/ready").status_code == 200

        model = running.engine.info.model_id
        # Without the client's retries of UNAVAILABLE, to see the draining server's own answer.
        with Client(running.target, options=[("grpc.enable_retries", 0)]) as c:
            grpc_stream = c.stream(prompt="hi", max_new_tokens=200, ignore_eos=True, timeout=TIMEOUT)
            next(grpc_stream)
            http_stream = iter(chat(sdk, model, stream=True, max_tokens=200, extra_body={"ignore_eos": True}))
            next(http_stream)
            delay = 4.0  # --drain-delay-seconds: not ready at once, still serving until the balancers catch up
            draining = asyncio.run_coroutine_threadsafe(running.server.drain(delay_seconds=delay), running.loop)
            started = time.time()
            deadline = started + 10  # drain runs on the server's loop; give it a moment to flip health
            while health_status(running.target) != not_serving:
                assert time.time() < deadline, "health still SERVING while draining"
                time.sleep(0.02)
            while httpx.get(url + "/ready").status_code != 503:
                assert time.time() < deadline, "still ready while draining"
                time.sleep(0.02)
            # within the delay, new requests on both fronts are still served
            assert (
                c.generate(prompt="hi", max_new_tokens=2, ignore_eos=True, timeout=TIMEOUT).usage.completion_tokens == 2
            )
            assert chat(sdk, model, max_tokens=2, extra_body={"ignore_eos": True}).usage.completion_tokens == 2
            assert time.time() - started < delay, "the machine was too slow to see the delay"
            refused = False
            while not refused:  # after it, they are refused
                assert time.time() < deadline + delay, "still taking new requests after the drain delay"
                try:
                    c.generate(prompt="hi", max_new_tokens=1, timeout=TIMEOUT)
                    time.sleep(0.05)
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
                    refused = True
            with pytest.raises(openai.InternalServerError) as err:
                chat(sdk, model, max_tokens=2)
            assert "draining" in err.value.body["message"]
            # in flight: both finish
            assert list(grpc_stream)[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert [c.choices[0].finish_reason for c in http_stream if c.choices][-1] == "length"
            draining.result(TIMEOUT)
        running.drained = True
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        sdk.close()
        running.stop()


def test_streamed_completion_logprobs_give_the_offsets_of_the_whole_response(sdk, model):
    """A token whose text ends inside a multi-byte character is sent with its logprob before its text: the
    streamed offsets still count every token's text, as the whole response's do.

    Whether a reply has such a token depends on the random model's numerics (they differ between CPUs), so
    several requests are tried, greedy and seeded, with prompts of multi-byte text; each is checked, until
    one has the case."""
    prompts = ["Hello", "日本語のテキスト：", "Ünïcödé ✓ → ∞ 😀🎉", "中文，한국어, ελληνικά"]
    requests = [{"prompt": p, **GREEDY} for p in prompts]
    requests += [{"prompt": p, **GREEDY, "temperature": 1.0, "seed": seed} for seed in (1, 2) for p in prompts]
    for request in requests:
        body = {"model": model, "logprobs": 1, **request, "max_tokens": 40}
        whole = sdk.completions.create(**body).choices[0]
        chunks = [c.choices[0] for c in sdk.completions.create(stream=True, **body) if c.choices]
        streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
        assert streamed == whole.logprobs.text_offset, request
        assert "".join(c.text for c in chunks) == whole.text, request
        # some token's text came in a later chunk than its logprob: the case is tested
        if any(len(c.text) != sum(map(len, c.logprobs.tokens)) for c in chunks if c.logprobs):
            break
    else:
        pytest.fail(f"none of {len(requests)} replies had a token ending inside a character: the case was not tested")


def test_metrics_on_the_api_port_and_the_ready_line(server, sdk, model, caplog):
    """The metrics page is served on the API's port too (as vLLM's, llama.cpp's and OVMS's), without a token;
    the last line of a start names the model, every address and the versions."""
    chat(sdk, model, **GREEDY)
    page = httpx.get(server.url + "/metrics", timeout=TIMEOUT)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    assert 'ovserve_http_requests_total{endpoint="chat.completions",status="200",tenant="default"}' in page.text
    line = server.server.ready_line(server.engine)
    for place in (f"gRPC 127.0.0.1:{server.server.port}", f"OpenAI API {server.url}/v1", f"playground {server.url}/"):
        assert place in line
    assert "ovserve " in line and "OpenVINO 20" in line


def test_the_default_model_samples_as_its_authors_recommend(smol_server):
    """SmolLM2 converted by `python -m convert smollm2` carries its model card's temperature 0.2 and top_p 0.9:
    a request that sets no sampling field gets the reply of one that sets them (same seed), not the word salad
    of OpenAI's temperature 1."""
    assert smol_server.engine.info.sampling_defaults == (("temperature", 0.2), ("top_p", 0.9))
    with openai_client(smol_server) as sdk:
        model = smol_server.engine.info.model_id
        ask = {"max_tokens": 24, "seed": 3}

        def reply(**kw):
            return chat(sdk, model, "Write a haiku about autumn.", **ask, **kw).choices[0].message.content

        unset = reply()
        assert unset == reply(temperature=0.2, top_p=0.9)
        assert unset != reply(temperature=1.0, top_p=1.0), unset  # what the model gave before: OpenAI's defaults
