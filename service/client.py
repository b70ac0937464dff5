"""A small client for ovserve.v1.Generation, and `python -m service.client` to chat from a terminal.

from service.client import Client

with Client("localhost:50051") as client:
    for delta in client.stream_chat([{"role": "user", "content": "Hi!"}], max_new_tokens=64):
        print(delta, end="", flush=True)
    reply = client.generate(prompt="The capital of France is", max_new_tokens=8)
    print(reply.text, reply.finish_reason, reply.usage.completion_tokens)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.api.ovserve.v1 import ovserve_pb2_grpc as pb_grpc
from service.wire import SAMPLING_FIELDS as OPTIONS


def build_request(
    messages: Sequence[dict[str, str]] | None = None,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    request_id: str | None = None,
    cache_salt: str | None = None,
    **options,
) -> pb.GenerateRequest:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    request = pb.GenerateRequest(
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        **{k: v for k, v in options.items() if v is not None},
    )
    if request_id is not None:
        request.request_id = request_id
    if cache_salt is not None:
        request.cache_salt = cache_salt
    if messages is not None:
        request.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    if prompt is not None:
        request.prompt = prompt
    if prompt_token_ids is not None:
        request.prompt_token_ids.extend(prompt_token_ids)
    return request


class Client:
    """Blocking client. token: bearer token; root_certificates: PEM of the CA that signed the server's
    certificate (TLS); timeout: default deadline in seconds of each call."""

    def __init__(
        self,
        target: str = "localhost:50051",
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=list(options))
        else:
            self.channel = grpc.insecure_channel(target, options=list(options))
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, timeout: float | None = None, **request) -> pb.GenerateResponse:
        """The whole reply; request takes build_request's arguments."""
        return self.stub.Generate(build_request(**request), timeout=self._timeout(timeout), metadata=self.metadata)

    def stream(self, timeout: float | None = None, **request) -> Iterator[pb.GenerateStreamResponse]:
        """The reply as it is generated; cancel() the returned iterator to abort the request."""
        return self.stub.GenerateStream(
            build_request(**request), timeout=self._timeout(timeout), metadata=self.metadata
        )

    def stream_chat(self, messages: Sequence[dict[str, str]], **request) -> Iterator[str]:
        """Text deltas of the assistant's reply to messages."""
        for chunk in self.stream(messages=messages, **request):
            yield chunk.text

    def tokenize(
        self, text: str | None = None, messages: Sequence[dict[str, str]] | None = None, timeout: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in messages or ()])
        if text is not None:
            request.text = text
        return list(self.stub.Tokenize(request, timeout=self._timeout(timeout), metadata=self.metadata).token_ids)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout), metadata=self.metadata)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m service.client", description="Stream the model's chat reply to a message."
    )
    p.add_argument("message", nargs="*", help="the user message (read from stdin when absent)")
    p.add_argument("--target", default="localhost:50051", help="server address (default %(default)s)")
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
    p.add_argument("--timeout", type=float, help="deadline in seconds")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--ca-cert", help="CA certificate (PEM) of a TLS server")
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
        for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty")
    }
    try:
        with Client(args.target, token, certs, args.timeout) as client:
            for chunk in client.stream(**inputs, stop=args.stop, **options):
                print(chunk.text, end="", flush=True)
                if chunk.finish_reason and args.usage:
                    u, t = chunk.usage, chunk.timings
                    print(
                        f"\n[{pb.FinishReason.Name(chunk.finish_reason)}] prompt {u.prompt_tokens} "
                        f"(cached {u.cached_prompt_tokens}), completion {u.completion_tokens} tokens; "
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
