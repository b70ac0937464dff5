"""A small client for ovserve.v1.Generation, and `python -m service.client` to chat from a terminal.

from service.client import Client, new_session_id

with Client("localhost:50051") as client:
    for delta in client.stream_chat([{"role": "user", "content": "Hi!"}], max_new_tokens=64):
        print(delta, end="", flush=True)
    reply = client.generate(prompt="The capital of France is", max_new_tokens=8)
    print(reply.text, reply.finish_reason, reply.usage.completion_tokens)

Many replicas: give several addresses (["10.0.0.1:50051", "10.0.0.2:50051"] or "ipv4:10.0.0.1:50051,10.0.0.2:50051")
or a DNS name that resolves to all of them ("dns:///ovserve-headless.ovserve.svc.cluster.local:50051"); requests
go round robin, and a request refused with UNAVAILABLE before any response is retried on another replica. Pass
the same session_id (new_session_id()) with every turn of a conversation so that a load balancer can keep it
on the replica that holds its prefix cache.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.api.ovserve.v1 import ovserve_pb2_grpc as pb_grpc

# GenerateRequest's proto3 `optional` scalar fields that map one to one onto sampling options (the server's
# wire module reads the same descriptor); unset ones keep the server's defaults.
_NOT_OPTIONS = ("request_id", "prompt", "cache_salt", "response_format", "tool_choice", "prediction")  # n: an option
OPTIONS = tuple(f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.has_presence and f.name not in _NOT_OPTIONS)


def build_request(
    messages: Sequence[dict[str, Any]] | None = None,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    request_id: str | None = None,
    cache_salt: str | None = None,
    response_format: pb.ResponseFormat | None = None,
    tools: Sequence[pb.Tool] = (),
    tool_choice: pb.ToolChoice | None = None,
    speculation: str | None = None,
    logit_bias: Mapping[int, float] | None = None,
    prediction: str | None = None,
    **options,
) -> pb.GenerateRequest:
    """speculation: "auto" or "off" (None: the server's default). logit_bias: token id -> bias in [-100, 100].
    n (an option) > 1 asks for several candidates: streamed messages carry their index, Generate's reply has
    them in choices. prediction: the reply expected (its tokens become drafts, verified exactly)."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    request = pb.GenerateRequest(
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        **{k: v for k, v in options.items() if v is not None},
    )
    if logit_bias:
        request.logit_bias.update(logit_bias)
    if request_id is not None:
        request.request_id = request_id
    if cache_salt is not None:
        request.cache_salt = cache_salt
    if prediction is not None:
        request.prediction = prediction
    if speculation is not None:
        request.speculation = pb.Speculation.Value(f"SPECULATION_{speculation.upper()}")
    if messages is not None:
        request.messages.extend(chat_message(m) for m in messages)
    if response_format is not None:
        request.response_format.CopyFrom(response_format)
    request.tools.extend(tools)
    if tool_choice is not None:
        request.tool_choice.CopyFrom(tool_choice)
    if prompt is not None:
        request.prompt = prompt
    if prompt_token_ids is not None:
        request.prompt_token_ids.extend(prompt_token_ids)
    return request


def chat_message(m: dict[str, Any]) -> pb.ChatMessage:
    """A chat turn from a dict: role and content, and for tool use tool_call_id, name and tool_calls (each a
    dict of id, name and arguments)."""
    calls = [pb.ToolCall(index=i, **c) for i, c in enumerate(m.get("tool_calls") or ())]
    return pb.ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        tool_call_id=m.get("tool_call_id", ""),
        name=m.get("name", ""),
        tool_calls=calls,
    )


SESSION_KEY = "x-session-id"  # the metadata key load balancers hash on (service/core/request.py checks it)

# Round robin over every address the target resolves to. Retries: gRPC retries a call only while no response
# has been received from the server (not even headers); once a reply has started it is never retried, so a
# retry never duplicates tokens. UNAVAILABLE before any response means the replica was loading, draining or
# unreachable: the next attempt goes to the next replica. maxAttempts counts the first try (gRPC caps it
# at 5); each wait is random up to the current backoff.
SERVICE_CONFIG: dict[str, Any] = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": [{"service": "ovserve.v1.Generation"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.25s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}
CHANNEL_OPTIONS: list[tuple[str, object]] = [
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
    # Our config, not one published in DNS TXT records, decides balancing and retries.
    ("grpc.service_config_disable_resolution", 1),
]


def new_session_id() -> str:
    """A fresh session key for a new conversation: 32 hex digits, valid wherever x-session-id is checked."""
    return uuid.uuid4().hex


def channel_target(target: str | Sequence[str]) -> str:
    """One gRPC target for one or several replicas. A string is used as is ("host:port", "dns:///name:port",
    "ipv4:a:p,b:q"); a list of IP address:port pairs becomes an ipv4: or ipv6: target. gRPC has no scheme for
    a list of host names: put them behind one DNS name instead."""
    if isinstance(target, str):
        return target
    if not target:
        raise ValueError("no target given")
    hosts = []
    for item in target:
        host, sep, port = item.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            ip = None
        if not sep or not port.isdigit() or ip is None:
            raise ValueError(
                f"{item!r}: give IP address:port pairs, or one dns:/// name that resolves to every replica"
            )
        hosts.append((ip, int(port)))
    versions = {ip.version for ip, _ in hosts}
    if len(versions) > 1:
        raise ValueError("mix of IPv4 and IPv6 addresses: gRPC takes one family per target")
    if versions == {4}:
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in hosts)
    return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, port in hosts)


class ReplicaLost(grpc.RpcError):
    """UNAVAILABLE for a call whose stream ended without a status: the replica answering it died or was cut
    off mid-reply behind a proxy. gRPC itself reports that as UNKNOWN (HAProxy ends the stream) or INTERNAL
    (Envoy resets it), both "Stream removed"; a direct connection to a dead replica already gives
    UNAVAILABLE. The reply had started, so it was not retried: send the turn again."""

    def __init__(self, cause: grpc.RpcError) -> None:
        super().__init__(cause)
        self._details = f"the replica was lost mid-reply ({cause.code().name}: {cause.details()})"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"UNAVAILABLE: {self._details}"


def _lost(exc: grpc.RpcError) -> bool:
    code, details = exc.code(), exc.details() or ""
    return code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and details.startswith("Stream removed")


class _Stream:
    """A response stream whose cut-off end is reported as ReplicaLost; cancel() and the call's other methods
    pass through."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[pb.GenerateStreamResponse]:
        return self

    def __next__(self) -> pb.GenerateStreamResponse:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            if _lost(exc):
                raise ReplicaLost(exc) from exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class Client:
    """Blocking client. target: one address, a gRPC target (dns:///, ipv4:), or a list of IP address:port
    pairs; token: bearer token; root_certificates: PEM of the CA that signed the server's certificate (TLS);
    timeout: default deadline in seconds of each call; options: gRPC channel options, ours replaced."""

    def __init__(
        self,
        target: str | Sequence[str] = "localhost:50051",
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        given = {name for name, _ in options}
        merged = [o for o in CHANNEL_OPTIONS if o[0] not in given] + list(options)
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates)
            self.channel = grpc.secure_channel(channel_target(target), creds, options=merged)
        else:
            self.channel = grpc.insecure_channel(channel_target(target), options=merged)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _metadata(self, session_id: str | None) -> tuple[tuple[str, str], ...]:
        return self.metadata + ((SESSION_KEY, session_id),) if session_id else self.metadata

    def generate(self, timeout: float | None = None, session_id: str | None = None, **request) -> pb.GenerateResponse:
        """The whole reply; request takes build_request's arguments. session_id: the conversation's key
        (new_session_id()), the same for all its turns."""
        try:
            return self.stub.Generate(
                build_request(**request), timeout=self._timeout(timeout), metadata=self._metadata(session_id)
            )
        except grpc.RpcError as exc:
            if _lost(exc):
                raise ReplicaLost(exc) from exc
            raise

    def stream(
        self, timeout: float | None = None, session_id: str | None = None, **request
    ) -> Iterator[pb.GenerateStreamResponse]:
        """The reply as it is generated; cancel() the returned iterator to abort the request."""
        call = self.stub.GenerateStream(
            build_request(**request), timeout=self._timeout(timeout), metadata=self._metadata(session_id)
        )
        return _Stream(call)

    def stream_chat(self, messages: Sequence[dict[str, Any]], **request) -> Iterator[str]:
        """Text deltas of the assistant's reply to messages."""
        for chunk in self.stream(messages=messages, **request):
            yield chunk.text

    def tokenize(
        self,
        text: str | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        timeout: float | None = None,
        tools: Sequence[pb.Tool] = (),
        tool_choice: pb.ToolChoice | None = None,
    ) -> list[int]:
        request = pb.TokenizeRequest(messages=[chat_message(m) for m in messages or ()], tools=list(tools))
        if text is not None:
            request.text = text
        if tool_choice is not None:
            request.tool_choice.CopyFrom(tool_choice)
        return list(self.stub.Tokenize(request, timeout=self._timeout(timeout), metadata=self.metadata).token_ids)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout), metadata=self.metadata)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m service.client", description="Stream the model's chat reply to a message."
    )
    p.add_argument("message", nargs="*", help="the user message (read from stdin when absent)")
    p.add_argument(
        "--target",
        default="localhost:50051",
        help="server address, a dns:/// name, or ipv4:a:p,b:q for several replicas (default %(default)s)",
    )
    p.add_argument("--session-id", help="x-session-id to send (routes a conversation's turns to one replica)")
    p.add_argument("--system", help="a system message before the user message")
    p.add_argument("--raw", action="store_true", help="send the text as a raw prompt, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, help="0 decodes greedily (the server's default)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--priority", type=int, help="among your tenant's waiting requests: lower is admitted first")
    p.add_argument("--timeout", type=float, help="deadline in seconds")
    p.add_argument("--token-file", help="file holding the bearer token (the API key)")
    p.add_argument("--ca-cert", help="CA certificate (PEM) of a TLS server")
    p.add_argument(
        "--no-thinking",
        action="store_true",
        help="switch a reasoning model's thinking off (enable_thinking=false); otherwise its reasoning goes to stderr",
    )
    p.add_argument("--usage", action="store_true", help="print token counts and timings to stderr at the end")
    args = p.parse_args(argv)
    text = " ".join(args.message) if args.message else sys.stdin.read()
    if not text.strip():
        p.error("no message given (as arguments or on stdin)")
    if args.raw:
        inputs: dict = {"prompt": text}
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        inputs = {"messages": [*messages, {"role": "user", "content": text.strip()}]}
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    certs = Path(args.ca_cert).read_bytes() if args.ca_cert else None
    options = {
        name: getattr(args, name)
        for name in (
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "repetition_penalty",
            "priority",
        )
    }
    if args.no_thinking:
        options["enable_thinking"] = False
    try:
        with Client(args.target, token, certs, args.timeout) as client:
            for chunk in client.stream(**inputs, stop=args.stop, session_id=args.session_id, **options):
                if chunk.reasoning_text:  # the reasoning apart from the answer on stdout
                    print(chunk.reasoning_text, end="", file=sys.stderr, flush=True)
                print(chunk.text, end="", flush=True)
                if chunk.finish_reason and args.usage:
                    u, t = chunk.usage, chunk.timings
                    print(
                        f"\n[{pb.FinishReason.Name(chunk.finish_reason)}] prompt {u.prompt_tokens} "
                        f"(cached {u.cached_prompt_tokens}), completion {u.completion_tokens} tokens "
                        f"({u.reasoning_tokens} reasoning); "
                        f"ttft {t.time_to_first_token_seconds:.3f} s, total {t.total_seconds:.3f} s",
                        file=sys.stderr,
                    )
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
