"""The HTTP port's bounds and what clients that misbehave cost, on a real server (no model needed: these happen
before a request reaches the engine): silent and half-sent connections are closed at their deadlines while
other requests are served as usual, connections beyond the cap are closed at once, a client that vanishes
while sending its body is a 499 (never a 500), and the parser's own refusals come in OpenAI's error shape."""

import asyncio
import socket
import threading
import time

import httpx
import pytest

from service.config import ServerConfig
from service.process import Server
from tests.support.servers import free_port

HEAD_SECONDS = 2.0
BODY_SECONDS = 1.0
CAP = 300


class Running:
    """A Server (no engine attached) on its own event loop thread."""

    def __init__(self, config: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = self.call(self.make(config))
        self.port = self.server.http.port

    async def make(self, config: ServerConfig) -> Server:
        server = Server(config)
        await server.start()
        return server

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.call(self.server.drain(grace_seconds=0, delay_seconds=0))
        self.loop.call_soon_threadsafe(self.loop.stop)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def dropped(self, reason: str) -> float:
        return self.server.metrics.dropped_connections.labels(reason)._value.get()

    def requests(self, endpoint: str, status: int) -> float:
        """Over every tenant label (a call refused before its key was read has none)."""
        samples = self.server.metrics.http_requests.collect()[0].samples
        labels = {"endpoint": endpoint, "status": str(status)}
        return sum(s.value for s in samples if s.name.endswith("_total") and labels.items() <= s.labels.items())


def serve(head_seconds: float):
    config = ServerConfig(
        model="unused",
        port=0,
        http_port=free_port(),
        metrics_port=0,
        http_head_timeout_seconds=head_seconds,
        http_body_timeout_seconds=BODY_SECONDS,
        http_max_connections=CAP,
    )
    running = Running(config)
    yield running
    running.stop()


@pytest.fixture
def running():
    yield from serve(HEAD_SECONDS)


@pytest.fixture
def patient():
    """Silent connections stay open long enough to open CAP of them on a busy host (their deadline, not the
    cap, closed some in a run beside other tests)."""
    yield from serve(60.0)


def closed_by_server(s: socket.socket) -> bool:
    s.settimeout(0.05)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def wait_until(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_silent_and_half_sent_connections_are_closed_at_their_deadlines_while_others_are_served(running):
    silent = [running.connect() for _ in range(120)]
    half_head = []
    for _ in range(100):
        s = running.connect()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        half_head.append(s)
    half_body = []
    for _ in range(20):
        s = running.connect()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"mess'
        )
        half_body.append(s)
    # 240 connections held open: a normal request is answered as quickly as without them
    started = time.monotonic()
    with httpx.Client(base_url=f"http://127.0.0.1:{running.port}") as client:
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 503  # no engine: answered, not hung
    assert time.monotonic() - started < HEAD_SECONDS  # served before any deadline passed
    assert not any(closed_by_server(s) for s in silent[:5])  # still open before their deadline
    everyone = silent + half_head + half_body
    assert wait_until(lambda: all(closed_by_server(s) for s in everyone), HEAD_SECONDS + BODY_SECONDS + 5)
    assert running.dropped("head_timeout") == len(silent) + len(half_head)
    assert running.dropped("body_timeout") == len(half_body)
    # a client cut off in its body went away as far as the API is concerned: 499, never a server error
    assert wait_until(lambda: running.requests("chat.completions", 499) == len(half_body), 5)
    assert running.requests("chat.completions", 500) == 0
    for s in everyone:
        s.close()


def test_connections_beyond_the_cap_are_closed_at_once(patient):
    held = [patient.connect() for _ in range(CAP)]
    time.sleep(0.2)
    extra = [patient.connect() for _ in range(10)]
    assert wait_until(lambda: all(closed_by_server(s) for s in extra), 2)
    assert patient.dropped("connection_limit") == len(extra)
    assert not any(closed_by_server(s) for s in held[:10])
    for s in held + extra:
        s.close()


def test_a_keep_alive_connection_sending_a_new_head_slowly_is_closed(running):
    s = running.connect()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's head never ends
    assert wait_until(lambda: closed_by_server(s), HEAD_SECONDS + 3)
    assert running.dropped("head_timeout") == 1
    s.close()


def test_a_client_gone_while_sending_its_body_is_a_client_disconnect(running):
    s = running.connect()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": "a'
    )
    time.sleep(0.1)
    s.close()
    assert wait_until(lambda: running.requests("completions", 499) == 1, 5)
    assert running.requests("completions", 500) == 0


def test_the_parsers_own_refusal_is_an_openai_error(running):
    s = running.connect()
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n")
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert b'"type": "invalid_request_error"' in body and b'"code": "invalid_request"' in body
    s.close()
