"""The HTTP front's routes (Starlette): the OpenAI API, liveness and readiness, and the playground.

Like the gRPC servicers, the handlers only translate (openai_in.py, openai_out.py), call the engine and map
errors through one table (errors.py); the engine validates. A request's body is read and
checked before anything reaches the engine, and nothing is sent before the engine's first output, so every
refusal (a range, a full queue, a draining server) gets its own status code. A client that disconnects
aborts its request: closing the engine's stream frees its KV blocks within a step."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any, Protocol, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from service.config import ServerConfig, hosts, origins
from service.core import json_input
from service.core.outputs import RequestOutput
from service.core.request import SESSION_KEY, Tenant, session_key
from service.core.stats import ModelInfo
from service.engine import EngineClient, GenerationRequest
from service.engine.tokenizer import Tokenizer
from service.errors import InvalidArgument
from service.http import openai_in, openai_out, sse
from service.http.errors import CrossOrigin, NotFound, TooLarge, Unauthenticated, error_body, status_of
from service.http.host_check import HostCheck, is_loopback
from service.http.responses_in import parse_responses
from service.http.responses_out import ResponseReply
from service.metrics import Metrics, TokenClocks
from service.serving.auth import Auth
from service.serving.call import Call
from service.serving.prompt import encode, encode_prediction, reasons
from service.serving.state import Serving

log = logging.getLogger("service.http")

REQUEST_ID_HEADER = "X-Request-Id"
CLIENT_GONE = 499  # nginx's "client closed request": counted and logged, never sent
MAX_SHOWN_CHARS = 200  # of a client's text quoted in a log line
# The playground loads nothing but its own files, and no other site may frame it: the browser enforces both.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}
T = TypeVar("T")


class PageFiles(StaticFiles):
    """The playground's scripts and styles, with the page's headers."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(PAGE_HEADERS)
        return response


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


# -- one request's bookkeeping -----------------------------------------------------------------------------
def refuse(call: Call, exc: Exception) -> Response:
    """The response that refuses a call, counted and logged once."""
    if isinstance(exc, ClientGone):
        call.finish(CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)  # nobody reads it
    status = finish_failed(call, exc)
    headers = id_header(call) | ({"WWW-Authenticate": "Bearer"} if status == 401 else {})
    return JSONResponse(error_body(exc), status, headers)


def finish_failed(call: Call, exc: Exception) -> int:
    """Count and log a call that ended with exc (a refusal, or a server failure with its traceback); its status."""
    status = status_of(exc).code
    call.finish(status, exc, failed=status == 500)
    return status


def id_header(call: Call) -> dict[str, str]:
    return {REQUEST_ID_HEADER: call.request_id} if call.request_id else {}


# -- reading a request -------------------------------------------------------------------------------------
async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, read no further than limit bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the body has {declared} bytes; the limit is {limit} (--max-message-bytes)")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the body is larger than the limit of {limit} bytes (--max-message-bytes)")
            chunks.append(chunk)
    except ClientDisconnect:  # gone while sending its body (or closed for the body deadline): not our failure
        raise ClientGone from None
    return await asyncio.to_thread(json_input.parse_object, b"".join(chunks), "")  # its checks walk a large body


def refuse_other_origins(request: Request, allowed: set[str]) -> None:
    """A browser names the page that sent a request (Origin); any page may send a plain-text POST to a server on
    the visitor's machine without asking first, and without a token the server would generate for it. Clients
    that are not browsers send no Origin; the playground's is the server's own host (or, behind a proxy, the
    host it forwards, which a page of another origin cannot set without the browser asking first), and
    --allowed-origins names others (a proxy that rewrites Host, a browser extension; * for any). Against DNS
    rebinding, where the Host header is the attacker's name too, see host_check."""
    origin = request.headers.get("origin")
    if origin is None or "*" in allowed or origin in allowed:
        return
    forwarded = request.headers.get("x-forwarded-host", "")  # a list when proxies are chained
    own = {request.headers.get("host"), *(host.strip() for host in forwarded.split(","))} - {None, ""}
    if origin.partition("://")[2] not in own:
        shown = origin[:MAX_SHOWN_CHARS].encode("ascii", "backslashreplace").decode()
        raise CrossOrigin(f"a page of another origin ({shown}) cannot call this API from a browser")


def prompt_ids(tokenizer: Tokenizer, parsed: openai_in.ApiRequest) -> tuple[list[int], str, list[int]]:
    """The request's input as token ids, the field it came from (for errors), and its predicted output's ids."""
    ids, field = _input_ids(tokenizer, parsed)
    return ids, field, encode_prediction(tokenizer, parsed.prediction)


def _input_ids(tokenizer: Tokenizer, parsed: openai_in.ApiRequest) -> tuple[list[int], str]:
    if parsed.messages is not None:
        thinking = parsed.enable_thinking
        return encode(tokenizer, "messages", messages=parsed.messages, tools=parsed.tools, enable_thinking=thinking), (
            "messages"
        )
    if isinstance(parsed.prompt, str):
        return encode(tokenizer, "prompt", text=parsed.prompt), "prompt"
    return encode(tokenizer, "prompt", token_ids=parsed.prompt), "prompt"


def check_model(name: str | None, info: ModelInfo) -> None:
    """A request may leave the model out; one that names another model is refused rather than answered by
    this one."""
    if name is not None and name != info.model_id:
        shown = name[:MAX_SHOWN_CHARS]
        raise NotFound("model", f"the model {shown!r} does not exist; this server serves {info.model_id!r}")


def token_text(tokenizer: Tokenizer) -> Callable[[int], str]:
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


# -- the client going away ---------------------------------------------------------------------------------
async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of work, unless the client disconnects first: then work is cancelled (an engine stream
    inside it closes, which aborts its request) and ClientGone raised. The body must have been read."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        first = task.done()
        gone.cancel()
        task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)  # the cancelled work has unwound
    if not first:
        raise ClientGone
    return task.result()


async def collect(stream: AsyncIterator[RequestOutput], clock: TokenClocks, everything: bool) -> list[RequestOutput]:
    """The first output, or all of them (every choice's, to the end of the stream); `async for` does not close
    the stream when it stops early."""
    outputs = []
    async for out in stream:
        clock.tick(out)
        outputs.append(out)
        if not everything:
            break
    return outputs


class EventStream(StreamingResponse):
    """An SSE response that runs `done` however it ends: finished, the client gone, or cancelled by shutdown."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], done: Callable[[], Awaitable[None]], headers: dict[str, str]
    ) -> None:
        super().__init__(events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS | headers)
        self.events, self.done = events, done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()
            await self.done()


# -- the API -----------------------------------------------------------------------------------------------
Parse = Callable[[Mapping[str, Any], ModelInfo], openai_in.ApiRequest]


class Reply(Protocol):
    """The objects of one call's reply: whole, or as stream events (openai_out.Reply, responses_out)."""

    closing: tuple[bytes, ...]  # sent after the last event

    @property
    def done(self) -> bool: ...  # every choice has finished

    @property
    def summary(self) -> RequestOutput | None: ...  # the final output, usage combined (log line, metrics)

    def response(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]: ...

    def first_chunks(self) -> list[dict[str, Any]]: ...

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]: ...

    def encode(self, chunk: dict[str, Any]) -> bytes: ...

    def error_event(self, exc: Exception) -> dict[str, Any]: ...


MakeReply = Callable[[Any, str, str, Callable[[int], str]], Reply]


class Api:
    def __init__(
        self, serving: Serving, metrics: Metrics, auth: Auth, max_body_bytes: int, allowed_origins: str = ""
    ) -> None:
        self.serving, self.metrics, self.max_body_bytes = serving, metrics, max_body_bytes
        self.allowed_origins = origins(allowed_origins)
        self.auth = auth
        self.created = int(time.time())

    def authorize(self, request: Request) -> Tenant:
        """The tenant whose key the request carries (the default tenant when the server has no keys)."""
        given = request.headers.get("authorization", "").encode("latin-1")  # the header's own bytes
        tenant = self.auth.tenant_of(given)
        if tenant is None:
            raise Unauthenticated("missing or wrong bearer token (Authorization: Bearer <key>)")
        return tenant

    # -- generation --------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, "chat.completions", openai_in.parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completions", openai_in.parse_completion)

    async def responses(self, request: Request) -> Response:
        return await self.generate(request, "responses", parse_responses, ResponseReply)

    async def generate(
        self, request: Request, endpoint: str, parse: Parse, make_reply: MakeReply = openai_out.Reply
    ) -> Response:
        call = Call(self.serving, self.metrics, "http", endpoint, generation=True)
        try:
            engine, parsed, asked = await self.prepare(request, call, parse)
            reply = make_reply(parsed, engine.info.model_id, call.request_id or "", token_text(engine.tokenizer))
        except Exception as exc:  # the call ends here, counted, whatever failed
            return refuse(call, exc)
        stream = engine.generate(asked)
        clock = TokenClocks(self.metrics, call.started, call.tenant_name)
        try:
            outputs = await until_disconnected(request, collect(stream, clock, everything=not parsed.stream))
        except BaseException as exc:
            await stream.aclose()
            if not isinstance(exc, Exception):
                call.finish(CLIENT_GONE)  # cancelled: the server is stopping
                raise
            return refuse(call, parsed.renamed(exc) if isinstance(exc, InvalidArgument) else exc)
        if parsed.stream:
            events = self.events(call, reply, outputs[0], stream, clock, parsed.renamed)
            return EventStream(events, self.stream_done(call, stream), id_header(call))
        await stream.aclose()
        body = reply.response(outputs)
        call.output = reply.summary
        call.finish(200)
        return JSONResponse(body, headers=id_header(call))

    async def prepare(
        self, request: Request, call: Call, parse: Parse
    ) -> tuple[EngineClient, openai_in.ApiRequest, GenerationRequest]:
        """Everything checked before the engine sees the request; the token before the body is read."""
        refuse_other_origins(request, self.allowed_origins)
        call.tenant = tenant = self.authorize(request)
        call.label(request.headers.get(REQUEST_ID_HEADER), REQUEST_ID_HEADER)
        call.session_id = session_key(request.headers.getlist(SESSION_KEY))
        body = await read_json(request, self.max_body_bytes)
        engine = self.serving.require_engine()
        parsed = parse(body, engine.info)
        check_model(parsed.model, engine.info)
        try:
            # a long prompt takes seconds
            ids, field, predicted = await asyncio.to_thread(prompt_ids, engine.tokenizer, parsed)
            reasoning = reasons(engine.tokenizer, parsed.messages is not None, parsed.enable_thinking)
            asked = parsed.generation_request(
                ids, field, call.request_id, engine.info.max_model_len, reasoning, predicted
            )
        except InvalidArgument as exc:  # named as this request calls the field (a Responses input item)
            raise parsed.renamed(exc) from None
        return engine, parsed, replace(asked, tenant=tenant)

    async def events(
        self,
        call: Call,
        reply: Reply,
        out: RequestOutput,
        stream: AsyncIterator[RequestOutput],
        clock: TokenClocks,
        rename: Callable[[InvalidArgument], InvalidArgument],
    ) -> AsyncGenerator[bytes, None]:
        """The stream's events; an error after the status line is sent goes in the stream, naming the field as
        the request spelled it (rename: a Responses request's text.format, not the chat field it maps to)."""
        for chunk in reply.first_chunks():
            yield reply.encode(chunk)
        try:
            while True:
                for chunk in reply.chunks(out):
                    yield reply.encode(chunk)
                if reply.done:
                    call.output = reply.summary
                    break
                out = await anext(stream)
                clock.tick(out)
        except Exception as exc:  # the status line is sent: the error goes in the stream, as OpenAI's do
            call.error = exc = rename(exc) if isinstance(exc, InvalidArgument) else exc
            yield reply.encode(reply.error_event(exc))
        for end in reply.closing:
            yield end

    def stream_done(self, call: Call, stream: AsyncGenerator[RequestOutput, None]) -> Callable[[], Awaitable[None]]:
        async def finish() -> None:  # exactly once, however the stream ends
            await stream.aclose()
            if call.error is not None:
                finish_failed(call, call.error)
            else:
                call.finish(200 if call.output is not None else CLIENT_GONE)

        return finish

    # -- models, health ----------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        call = Call(self.serving, self.metrics, "http", "models")
        try:
            call.tenant = self.authorize(request)
            info = self.serving.require_engine().info
            if "model" in request.path_params:
                check_model(request.path_params["model"], info)
        except Exception as exc:
            return refuse(call, exc)
        call.finish(200)
        model = openai_out.model_object(info, self.created)
        return JSONResponse(model if "model" in request.path_params else {"object": "list", "data": [model]})

    async def metrics_text(self, request: Request) -> Response:
        """The metrics port's page on the API's port too, as vLLM, llama.cpp and OVMS serve it; like the probes,
        it needs no token (it holds counts, never request content)."""
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """503 while the model loads, while draining and once the engine stopped: take this replica out."""
        reason = self.serving.unready()
        if reason is not None:
            return JSONResponse(error_body(reason), status_of(reason).code)
        return JSONResponse({"status": "ready"})

    async def playground(self, request: Request) -> Response:
        page = resources.files("service.http").joinpath("static/playground.html").read_text()
        return HTMLResponse(page, headers=PAGE_HEADERS)

    async def no_route(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
        message = f"no route {request.method} {request.url.path[:MAX_SHOWN_CHARS]}"
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        headers = exc.headers if isinstance(exc, HTTPException) else None  # a 405 names the methods (Allow)
        return JSONResponse(body, status, headers)


def build_app(serving: Serving, metrics: Metrics, auth: Auth, config: ServerConfig, bound_address: str) -> Starlette:
    """bound_address: the address the HTTP socket listens on (a name in --host may resolve to loopback)."""
    api = Api(serving, metrics, auth, config.max_message_bytes, config.allowed_origins)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.models, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
        Route("/health", api.live, methods=["GET"]),
        Route("/livez", api.live, methods=["GET"]),
        Route("/ready", api.ready, methods=["GET"]),
        Route("/readyz", api.ready, methods=["GET"]),
        Route("/", api.playground, methods=["GET"]),
        Mount("/static", PageFiles(packages=[("service.http", "static")]), name="static"),
    ]
    host_check = Middleware(
        HostCheck,
        allowed=hosts(config.allowed_hosts),
        bound_to_loopback=is_loopback(bound_address),
        count=lambda: metrics.observe_http("any", 403, 0.0),
    )
    middleware = [host_check]
    return Starlette(routes=routes, exception_handlers={HTTPException: api.no_route}, middleware=middleware)
