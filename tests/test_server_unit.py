"""The server without a model: proto <-> domain translation, the error table, config, auth and the
generated code; then a real gRPC server on localhost around a scripted fake engine."""

import asyncio
import json
import logging
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import Client, build_request
from service.config import ServerConfig, parse_args
from service.core.outputs import FinishReason, RequestOutput, Timings, TokenLogprob, Usage
from service.core.params import SamplingParams
from service.errors import DeadlineExceeded, EngineFailure, InvalidArgument, QueueFull, Unavailable
from service.metrics import Metrics, TokenClock
from service.process import Server, start_server
from service.rpc.front import authorized
from service.rpc.status import status_details, status_of
from service.rpc.wire import generation_request, sampling_params, stream_response, tokenize_ids, unary_response
from service.serving.auth import Auth
from tests.support.fakes import INFO, FakeEngine, FakeTokenizer, LoopThread
from tests.support.paths import ROOT
from tests.support.servers import free_port, self_signed_cert

TIMEOUT = 30


# -- proto -> domain -------------------------------------------------------------------------------------
def test_unset_fields_take_sampling_defaults():
    assert sampling_params(pb.GenerateRequest(prompt="x")) == SamplingParams()


def test_zero_is_a_real_value():
    request = build_request(prompt="x", temperature=0.0, top_k=0, seed=0, max_new_tokens=0, min_p=0.0)
    assert request.HasField("temperature") and request.HasField("seed")
    params = sampling_params(request)
    assert (params.max_new_tokens, params.seed, params.temperature) == (0, 0, 0.0)


def test_every_field_reaches_sampling_params():
    request = build_request(
        prompt="x",
        max_new_tokens=7,
        min_new_tokens=2,
        temperature=0.5,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        seed=123,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 8],
        include_stop_str_in_output=True,
        ignore_eos=True,
        logprobs=3,
    )
    p = sampling_params(request)
    assert (p.max_new_tokens, p.min_new_tokens, p.top_k, p.seed, p.logprobs) == (7, 2, 40, 123, 3)
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9) and p.min_p == pytest.approx(0.05)
    assert p.repetition_penalty == pytest.approx(1.1)
    assert (p.presence_penalty, p.frequency_penalty) == (pytest.approx(0.5), pytest.approx(-0.5))
    assert (p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos) == (
        ("\n\n", "END"),
        (7, 8),
        True,
        True,
    )


def prompt_input(tokenizer, request):
    asked = generation_request(tokenizer, request, "id", None)
    return list(asked.prompt_token_ids), asked.prompt_field


def test_inputs():
    tok = FakeTokenizer()
    assert prompt_input(tok, build_request(prompt="ab")) == (tok.encode("ab"), "prompt")
    assert prompt_input(tok, build_request(prompt_token_ids=[1, 2, 3])) == ([1, 2, 3], "prompt_token_ids")
    chat = build_request(messages=[{"role": "user", "content": "hi"}])
    assert prompt_input(tok, chat) == (tok.encode("<user>hi<assistant>"), "messages")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "exactly one"),
        ({"prompt": ""}, "prompt: must not be empty"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
    ],
)
def test_bad_inputs(kwargs, needle):
    with pytest.raises(InvalidArgument) as err:
        prompt_input(FakeTokenizer(), build_request(**kwargs))
    assert needle in str(err.value)


def test_tokenize_errors_name_the_field_sent():
    with pytest.raises(InvalidArgument, match="^text: must not be empty"):
        tokenize_ids(FakeTokenizer(), pb.TokenizeRequest(text=""))
    with pytest.raises(InvalidArgument, match="^messages"):
        tokenize_ids(FakeTokenizer(), pb.TokenizeRequest(messages=[pb.ChatMessage(role="wizard", content="x")]))


# -- domain -> proto -------------------------------------------------------------------------------------
OUTPUTS = [
    RequestOutput("r1", (5,), "He", (TokenLogprob(5, -0.1, ((5, -0.1), (6, -2.0))),)),
    RequestOutput("r1", (), ""),
    RequestOutput(
        "r1",
        (6, 7),
        "llo",
        (TokenLogprob(6, -0.2, ()), TokenLogprob(7, -0.3, ())),
        FinishReason.LENGTH,
        Usage(4, 3, 2),
        Timings(queue=0.01, ttft=0.1, decode=0.2, total=0.3),
    ),
]


def test_stream_and_unary_responses():
    chunks = [stream_response(o) for o in OUTPUTS]
    assert [c.text for c in chunks] == ["He", "", "llo"]
    assert chunks[0].finish_reason == pb.FINISH_REASON_UNSPECIFIED and not chunks[0].HasField("usage")
    last = chunks[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (4, 3, 2)
    assert last.timings.time_to_first_token_seconds == pytest.approx(0.1)
    assert last.timings.decode_seconds == pytest.approx(0.2)
    unary = unary_response(OUTPUTS)
    assert (unary.request_id, unary.text, list(unary.token_ids)) == ("r1", "Hello", [5, 6, 7])
    assert [lp.token_id for lp in unary.logprobs] == [5, 6, 7]
    assert list(unary.logprobs[0].top_token_ids) == [5, 6]
    assert unary.usage == last.usage and unary.finish_reason == pb.FINISH_REASON_LENGTH


def test_finish_reasons_cover_the_domain():
    names = {r.name for r in FinishReason} - {"ERROR"}  # ERROR becomes INTERNAL, not a finish reason
    assert {f"FINISH_REASON_{n}" for n in names} <= set(pb.FinishReason.keys())
    assert pb.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"


def test_error_table():
    assert status_of(InvalidArgument("top_p", "bad")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(QueueFull("full")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(Unavailable("loading")) == grpc.StatusCode.UNAVAILABLE
    assert status_of(DeadlineExceeded("late")) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_of(EngineFailure("boom")) == grpc.StatusCode.INTERNAL
    assert status_of(ZeroDivisionError()) == grpc.StatusCode.INTERNAL
    assert status_details(InvalidArgument("top_p", "must be in (0, 1], got 2")) == "top_p: must be in (0, 1], got 2"
    assert "secret" not in status_details(RuntimeError("secret path /etc/x"))
    # a message quoting a client's megabyte went whole into the log line and the status, which a gRPC client
    # refuses beyond 8 KiB of metadata (RESOURCE_EXHAUSTED instead of the INVALID_ARGUMENT it was)
    huge = status_details(InvalidArgument("messages[0].role", "got " + "R" * 1_000_000))
    assert len(huge) < 1100 and huge.endswith("(cut)")


# -- auth ------------------------------------------------------------------------------------------------
def test_authorized(tmp_path):
    token = tmp_path / "token"
    token.write_text("t0k\n")
    auth = Auth.from_files(str(token), None)
    gen = "/ovserve.v1.Generation/Generate"
    assert authorized(gen, (("authorization", "Bearer t0k"),), auth)
    assert not authorized(gen, (("authorization", "Bearer nope"),), auth)
    assert not authorized(gen, (("authorization", "t0k"),), auth)
    assert authorized(gen, (("authorization", "bearer t0k"),), auth)  # the scheme is case-insensitive
    assert not authorized(gen, (("authorization", "Basic t0k"),), auth)
    assert not authorized(gen, (), auth) and not authorized(gen, None, auth)
    assert authorized("/grpc.health.v1.Health/Check", (), auth)
    assert not authorized("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", (), auth)


def test_a_tls_key_that_is_not_the_certificates_is_named_at_start(tmp_path):
    # gRPC only said "Failed to bind to address" (the cause in a C-core log line before it)
    from service.rpc.front import check_key_pair

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    key_a, cert_a = self_signed_cert(tmp_path / "a")
    key_b, _ = self_signed_cert(tmp_path / "b")
    check_key_pair(str(cert_a), str(key_a))
    with pytest.raises(ValueError, match="--tls-cert .* and --tls-key .* are not a certificate and its key"):
        check_key_pair(str(cert_a), str(key_b))


def test_allowed_origins_are_read_as_browsers_send_them():
    from service.config import origins

    given = "https://App.Example.com:443/, http://localhost:3000, chrome-extension://abc, http://x.org:80"
    assert origins(given) == {
        "https://app.example.com",
        "http://localhost:3000",
        "chrome-extension://abc",
        "http://x.org",
    }
    assert origins("") == set() and origins("*") == {"*"}
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--allowed-origins", "https://app.example.com/chat"], env={})


def test_allowed_hosts_are_names_and_a_loopback_server_answers_only_them_localhost_and_addresses():
    from service.config import hosts
    from service.http.host_check import HostCheck, is_loopback

    assert hosts(" Chat.Example.com., ovserve.default.svc ,") == {"chat.example.com", "ovserve.default.svc"}
    assert hosts("") == set() and hosts("*") == {"*"}
    for wrong in ("chat.example.com:8000", "https://chat.example.com", "a/b", "-x"):
        with pytest.raises(ValueError, match="is not a host name"):
            hosts(wrong)
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--allowed-hosts", "chat.example.com:8000"], env={})
    assert [is_loopback(a) for a in ("127.0.0.1", "::1", "localhost", "127.0.0.2", "0.0.0.0", "::", "10.0.0.1")] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]

    def answered(check: HostCheck) -> list[bool]:
        names = ["localhost:8000", "app.localhost", "127.0.0.1:8000", "[::1]:8000", "10.1.2.3:8000"]
        names += ["evil.example:8000", "evil.example", "chat.example.com", "[evil.example", None]
        names += ["[::1]evil.example", "localhost:evil.com", "[::1]:x"]  # not a name and a port of digits
        return [check.answers(name) for name in names]

    local = [True, True, True, True, True, False, False, False, False, True, False, False, False]
    assert answered(HostCheck(None, set(), bound_to_loopback=True)) == local  # type: ignore[arg-type]
    assert answered(HostCheck(None, {"chat.example.com"}, bound_to_loopback=True))[7]  # type: ignore[arg-type]
    assert all(answered(HostCheck(None, set(), bound_to_loopback=False)))  # type: ignore[arg-type]
    assert all(answered(HostCheck(None, {"*"}, bound_to_loopback=True)))  # type: ignore[arg-type]
    listed = answered(HostCheck(None, {"chat.example.com"}, bound_to_loopback=False))  # type: ignore[arg-type]
    assert listed == [True, True, True, True, True, False, False, True, False, True, False, False, False]


def model_folder(folder) -> str:
    """A folder that passes the start's model check (the model is never loaded in these tests)."""
    for name in ("config.json", "generation_config.json", "manifest.json", "tokenizer.json"):
        (folder / name).write_text("{}")
    (folder / "openvino_model.xml").write_text("<net/>")
    (folder / "openvino_model.bin").write_bytes(b"")
    return str(folder)


def test_a_server_that_cannot_start_says_why_and_frees_its_ports(caplog, tmp_path):
    # a taken metrics port failed after gRPC had started and the HTTP port was bound: both stayed taken
    import socket

    from service.process import run as serve

    taken = socket.create_server(("127.0.0.1", 0))
    grpc_port, http_port = free_port(), free_port()
    metrics_port = taken.getsockname()[1]
    config = ServerConfig(model=model_folder(tmp_path), port=grpc_port, http_port=http_port, metrics_port=metrics_port)
    try:
        assert asyncio.run(serve(config)) == 2  # a mistake in how it was started
    finally:
        taken.close()
    # one line naming the address, the flag and the variable that change it
    assert f"cannot start: cannot listen on 127.0.0.1:{metrics_port} (Address already in use)" in caplog.text
    assert "--metrics-port or OVSERVE_METRICS_PORT" in caplog.text
    for port in (grpc_port, http_port):
        socket.create_server(("127.0.0.1", port)).close()  # free again


@pytest.mark.parametrize("which", ["port", "http_port"])
def test_a_taken_port_is_named_with_its_flag(caplog, tmp_path, which):
    import socket

    from service.process import run as serve

    taken = socket.create_server(("127.0.0.1", 0))
    ports = {"port": free_port(), "http_port": free_port(), "metrics_port": 0} | {which: taken.getsockname()[1]}
    try:
        assert asyncio.run(serve(ServerConfig(model=model_folder(tmp_path), **ports))) == 2
    finally:
        taken.close()
    flag, variable = "--" + which.replace("_", "-"), "OVSERVE_" + which.upper()
    assert f"cannot listen on 127.0.0.1:{ports[which]}" in caplog.text
    assert f"choose another with {flag} or {variable}" in caplog.text
    assert "Traceback" not in caplog.text


def tokenizer_missing(folder):
    model_folder(folder)
    (folder / "tokenizer.json").unlink()


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda folder: None, "{folder} holds no openvino_model.xml; convert a model with `python -m convert`"),
        (lambda folder: folder.rmdir(), "{folder} does not exist; convert a model into it with `python -m convert"),
        (lambda folder: folder.rmdir() or folder.write_text(""), "{folder} is a file, not a model folder"),
        (tokenizer_missing, "{folder} holds no tokenizer.json: an incomplete model; convert the model again"),
    ],
    ids=["empty", "absent", "a file", "no tokenizer"],
)
def test_a_model_folder_without_a_model_is_named_before_any_port_is_bound(caplog, tmp_path, make, says):
    from service.process import run as serve

    folder = tmp_path / "model"
    folder.mkdir()
    make(folder)
    port = free_port()
    assert asyncio.run(serve(ServerConfig(model=str(folder), port=port, http_port=0, metrics_port=0))) == 2
    assert f"cannot start: --model {folder}: {says.format(folder=folder)}" in caplog.text
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "listening" not in caplog.text


def test_version_and_grouped_help(capsys):
    with pytest.raises(SystemExit) as done:
        parse_args(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("ovserve ") and "OpenVINO 2026" in out
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for group in ("model:", "serving:", "security:", "engine:", "cache:", "speculation:"):
        assert "\n" + group in text
    assert "(default 50051; env OVSERVE_PORT)" in " ".join(text.split())


# -- metrics port ----------------------------------------------------------------------------------------
def test_the_metrics_port_cuts_off_idle_clients_and_caps_their_threads(monkeypatch, capfd):
    # each connection held a thread for as long as its client kept it open, on a port without a token
    import socket
    import time

    import httpx

    from service.metrics import MetricsHandler, MetricsServer

    monkeypatch.setattr(MetricsHandler, "timeout", 0.5)
    monkeypatch.setattr(MetricsHandler, "lifetime", 1.0)
    metrics, port = Metrics(), free_port()
    metrics.serve(port, "127.0.0.1")
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MetricsServer.MAX_CONNECTIONS + 20)]
        for s in idle:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # the headers never end
        assert threading.active_count() - before <= 2 * MetricsServer.MAX_CONNECTIONS  # a handler and its deadline
        deadline = time.monotonic() + 20
        while threading.active_count() - before > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() - before <= 1  # every idle client was cut off
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert scrape.status_code == 200 and "ovserve_" in scrape.text
        for s in idle:
            s.close()
    finally:
        metrics.stop()
    assert "Traceback" not in capfd.readouterr().err  # cutting a client off is no error of the server's


# -- logs ------------------------------------------------------------------------------------------------
def test_text_log_lines_cannot_be_forged():
    from service.logs import TextFormatter

    record = logging.LogRecord(
        "service.rpc.front", logging.INFO, __file__, 1, "refused: %s", ("a\nFAKE\r\u2028x",), None
    )
    record.request_id = "id\n2026-12-03 00:00:00,000 INFO forged"
    line = TextFormatter().format(record)
    assert "\n" not in line and "\r" not in line and "\u2028" not in line
    assert "a\\x0aFAKE" in line and "request_id=id\\x0a2026" in line


# -- config ----------------------------------------------------------------------------------------------
def test_config_defaults_env_and_flags():
    assert parse_args(["--model", "m"], env={}) == ServerConfig(model="m")
    env = {
        "OVSERVE_MODEL": "/models/x",
        "OVSERVE_PORT": "6000",
        "OVSERVE_KV_CACHE_GB": "2.5",
        "OVSERVE_THREADS": "4",
        "OVSERVE_ENABLE_PREFIX_CACHING": "false",
        "OVSERVE_LOG_FORMAT": "json",
        "OVSERVE_DQ_GROUP_SIZE": "64",
        "OVSERVE_DETERMINISTIC": "0",
    }
    config = parse_args(["--max-num-seqs", "8", "--port", "7000"], env=env)
    engine = config.engine
    assert (config.model, config.port, engine.kv_cache_gb, engine.threads) == ("/models/x", 7000, 2.5, 4)
    assert (engine.max_num_seqs, engine.enable_prefix_caching, config.log_format) == (8, False, "json")
    assert parse_args(["--enable-prefix-caching"], env=env).engine.enable_prefix_caching
    assert engine.dq_group_size == 64
    assert not engine.deterministic and ServerConfig(model="m").engine.deterministic
    assert parse_args(["--no-deterministic"], env={"OVSERVE_MODEL": "m"}).engine.deterministic is False


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--model", "m", "--tls-cert", "c"],
        ["--model", "m", "--port", "70000"],
        ["--model", "m", "--threads", "0"],
        ["--model", "m", "--dq-group-size", "-1"],
    ],
)
def test_config_errors(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv, env={})


@pytest.mark.parametrize("flag", ["--auth-token-file", "--chat-template", "--tls-cert", "--tls-key"])
def test_a_file_flag_naming_no_file_is_one_line_at_start(flag, tmp_path, capsys):
    present = tmp_path / "present.pem"
    present.write_text("x")
    pair = {"--tls-cert": "--tls-key", "--tls-key": "--tls-cert"}  # each needs the other
    other = [pair[flag], str(present)] if flag in pair else []
    for given, says in ((tmp_path / "absent", "no such file"), (tmp_path, "not a file")):
        with pytest.raises(SystemExit) as done:
            parse_args(["--model", "m", flag, str(given), *other])
        assert done.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"python -m service: error: {flag} {given}: {says}"


def test_config_bad_env():
    with pytest.raises(SystemExit):
        parse_args(["--model", "m"], env={"OVSERVE_PORT": "many"})


# -- generated code --------------------------------------------------------------------------------------
def test_generated_code_matches_proto(tmp_path):
    out = tmp_path / "api"
    out.mkdir()
    protoc = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={out}", f"--pyi_out={out}"]
    subprocess.run([*protoc, f"--grpc_python_out={out}", "proto/ovserve/v1/ovserve.proto"], cwd=ROOT, check=True)
    subprocess.run([sys.executable, "scripts/fix_proto_imports.py", str(out)], cwd=ROOT, check=True)
    for name in ("ovserve_pb2.py", "ovserve_pb2.pyi", "ovserve_pb2_grpc.py"):
        committed = (ROOT / "service/api/ovserve/v1" / name).read_text()
        assert (out / "ovserve/v1" / name).read_text() == committed, f"{name} is stale: run `make proto`"


def test_every_proto_field_is_documented():
    proto = (ROOT / "proto/ovserve/v1/ovserve.proto").read_text().splitlines()
    for i, line in enumerate(proto):
        stripped = line.strip()
        is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("//", "syntax", "option"))
        if is_field or stripped.startswith(("message ", "enum ", "rpc ", "service ")):
            assert proto[i - 1].strip().startswith("//"), f"line {i + 1} has no comment: {stripped}"


# -- a real gRPC server around a fake engine -------------------------------------------------------------
def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service="")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


@pytest.fixture
def loop():
    loop = LoopThread()
    yield loop
    loop.close()


def test_start_server_serves_at_once(loop):
    engine = FakeEngine()
    engine.release.set()
    server, port = loop.run(start_server(engine, ServerConfig(model="", port=0, metrics_port=0, http_port=0)))
    assert engine.started.is_set() and health(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
    with Client(f"127.0.0.1:{port}", timeout=TIMEOUT) as c:
        assert c.generate(prompt_token_ids=[1], max_new_tokens=2).text == "AB"
    loop.run(server.drain())


def test_fake_engine_lifecycle_errors_and_auth(loop, tmp_path):
    token = tmp_path / "token"
    token.write_text("t0k\n")
    config = ServerConfig(
        model="",
        port=0,
        metrics_port=0,
        http_port=0,
        drain_grace_seconds=5,
        drain_delay_seconds=0,  # refusals at once: the drain delay has its own test (test_http)
        auth_token_file=str(token),
    )
    engine = FakeEngine()

    async def make() -> Server:
        server = Server(config)
        await server.start()
        return server

    server = loop.run(make())
    target = f"127.0.0.1:{server.port}"
    attaching = loop.spawn(server.attach(engine))  # blocks in engine.start() until released
    assert health(target) == health_pb2.HealthCheckResponse.NOT_SERVING
    with Client(target, token="t0k") as c, pytest.raises(grpc.RpcError) as err:
        c.generate(prompt="hi")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
    engine.release.set()
    attaching.result(TIMEOUT)
    assert health(target) == health_pb2.HealthCheckResponse.SERVING  # no token needed
    with Client(target) as anonymous, pytest.raises(grpc.RpcError) as err:
        anonymous.generate(prompt="hi")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(target, token="t0k", timeout=TIMEOUT) as c:
        reply = c.generate(prompt="hi", max_new_tokens=3)
        assert (reply.text, reply.finish_reason, reply.usage.completion_tokens) == ("ABC", pb.FINISH_REASON_LENGTH, 3)
        assert "".join(ch.text for ch in c.stream(prompt="hi", max_new_tokens=3)) == "ABC"
        assert c.model_info().model_id == "fake" and c.tokenize(text="ab") == [97, 98]
        for kwargs, code in (
            ({"prompt_token_ids": [99]}, grpc.StatusCode.INTERNAL),
            ({"prompt": "hi", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as err:
                c.generate(**kwargs)
            assert err.value.code() == code, err.value.details()
        bad_utf8 = {"Generate": b"\x1a\x02\xff\xfe", "GenerateStream": b"\x1a\x02\xff\xfe", "Tokenize": b"\x0a\x01\xff"}
        for method in ("Generate", "GenerateStream", "Tokenize", "GetModelInfo"):
            for body in (b"\xff\xff\xff", bad_utf8.get(method, b"\xff")):  # corrupt; invalid UTF-8 in a string
                call = c.channel.unary_unary if method != "GenerateStream" else c.channel.unary_stream
                rpc = call(f"/ovserve.v1.Generation/{method}", request_serializer=None, response_deserializer=None)
                with pytest.raises(grpc.RpcError) as err:
                    result = rpc(body, metadata=c.metadata, timeout=TIMEOUT)
                    list(result) if method == "GenerateStream" else result
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.details())
                assert err.value.details().startswith("request: not a valid ovserve.v1.")
        stream = c.stream(prompt="hi", max_new_tokens=60)
        next(stream)
        stream.cancel()
        loop.run(asyncio.sleep(0.2))
        assert not engine.live  # cancel closed the engine's stream
        long = c.stream(prompt="hi", max_new_tokens=50)
        next(long)
        draining = loop.spawn(server.drain())
        loop.run(asyncio.sleep(0.1))
        assert health(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt="hi", max_new_tokens=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(long)  # the in-flight stream finishes
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 50
        draining.result(TIMEOUT)
    assert engine.shut_down


def test_openai_requests_take_the_models_sampling_defaults_then_openais():
    from dataclasses import replace

    from service.http.openai_in import parse_chat

    body = {"messages": [{"role": "user", "content": "hi"}]}
    qwen = replace(INFO, sampling_defaults=(("temperature", 0.7), ("top_p", 0.8), ("top_k", 20.0)))
    p = parse_chat(body, qwen).params
    assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.8, 20)
    p = parse_chat(body | {"temperature": 0, "top_k": 5}, qwen).params
    assert (p.temperature, p.top_p, p.top_k, p.greedy) == (0, 0.8, 5, True)
    p = parse_chat(body, INFO).params  # a model without recommendations: OpenAI's temperature 1
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)


def test_model_files_read_sampling_defaults(tmp_path):
    from service.engine.model_files import ModelFiles

    model_folder(tmp_path)
    config = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True, "min_p": None, "eos_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert ModelFiles.read(tmp_path).sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20.0}


def test_the_start_log_says_which_sampling_http_requests_get_and_from_where():
    from service.process import sampling_note

    note = sampling_note((("temperature", 0.2), ("top_p", 0.9)), "models/m")
    assert (
        "sample at temperature 0.2, top_p 0.9 (the model's recommendation in models/m/generation_config.json)" in note
    )
    assert "gRPC requests decode greedily" in note
    note = sampling_note((("top_k", 20.0),), "models/m")
    assert (
        "at top_k 20, temperature 1 (the model's recommendation in models/m/generation_config.json, then OpenAI" in note
    )
    note = sampling_note((), "models/m")
    assert "at temperature 1 (OpenAI's default: models/m/generation_config.json recommends no sampling" in note


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", -1), ("top_p", 0), ("top_k", 2.5), ("repetition_penalty", 50)]
)
def test_model_files_refuse_out_of_range_sampling_defaults_naming_the_file(tmp_path, field, value):
    from service.engine.model_files import ModelFiles

    model_folder(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({field: value}))
    with pytest.raises(ValueError, match=rf"generation_config\.json: {field}: "):
        _ = ModelFiles.read(tmp_path).sampling_defaults


def test_tokens_that_arrive_together_share_the_inter_token_gap():
    """As vLLM counts them: 3 tokens 3 s after the previous output are three latencies of 1 s."""
    metrics = Metrics()
    now = iter([1.0, 4.0, 6.0, 7.0])
    clock = TokenClock(metrics, started=0.0, clock=lambda: next(now))
    for ids in ((1,), (2, 3, 4), (5, 6), ()):  # an output without tokens (the final one may be) is no tick
        clock.tick(RequestOutput("r", ids, ""))
    value = metrics.registry.get_sample_value
    assert value("ovserve_time_to_first_token_seconds_count", {"tenant": ""}) == 1
    assert value("ovserve_time_to_first_token_seconds_sum", {"tenant": ""}) == 1.0
    assert value("ovserve_inter_token_latency_seconds_count") == 5
    assert value("ovserve_inter_token_latency_seconds_sum") == 5.0
    assert value("ovserve_inter_token_latency_seconds_bucket", {"le": "1.0"}) == 5


def test_inference_precision_flag():
    assert parse_args(["--model", "m"], env={}).engine.inference_precision == "f32"
    assert parse_args(["--model", "m", "--inference-precision", "f32"], env={}).engine.inference_precision == "f32"
    env = {"OVSERVE_INFERENCE_PRECISION": "bf16"}
    assert parse_args(["--model", "m"], env=env).engine.inference_precision == "bf16"
    for bad in (["--inference-precision", "int8"], ["--inference-precision", ""]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *bad], env={})
    with pytest.raises(SystemExit):
        parse_args(["--model", "m"], env={"OVSERVE_INFERENCE_PRECISION": "fp64"})


def test_step_budget_flag_defaults_to_the_engines_choice_and_refuses_a_budget_no_piece_fits(capsys):
    from service.core.config import SAFE_STEP_TOKENS, EngineConfig

    assert parse_args(["--model", "m"], env={}).engine.max_num_batched_tokens is None
    assert parse_args(["--model", "m", "--max-num-batched-tokens", "4"], env={}).engine.max_num_batched_tokens == 4
    for bad in ("3", "0", "-512"):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--max-num-batched-tokens", bad], env={})
        assert "--max-num-batched-tokens must be at least 4" in capsys.readouterr().err
    # until the engine chooses one at start, a config's steps hold the budget that held on every CPU measured
    assert EngineConfig().step_budget == SAFE_STEP_TOKENS
    assert EngineConfig(max_num_batched_tokens=256).step_budget == 256
