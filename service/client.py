"""A small client for the Generation service, and `python -m service.client` to chat from a terminal.

from service.client import Client
with Client("localhost:50051") as c:
    for delta in c.stream_chat([{"role": "user", "content": "Hi!"}], max_new_tokens=64):
        print(delta, end="", flush=True)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.api.ovserve.v1 import ovserve_pb2_grpc as pb_grpc

SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
)
STOPPING_FIELDS = ("max_new_tokens", "min_new_tokens", "include_stop_str_in_output", "ignore_eos")


def build_request(
    messages: Sequence[dict[str, str]] | None = None,
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    stop: Sequence[str] = (),
    request_id: str = "",
    **options,
) -> pb.GenerateRequest:
    """Options are SamplingOptions and StoppingOptions fields by name; None leaves a field unset."""
    unknown = set(options) - set(SAMPLING_FIELDS) - set(STOPPING_FIELDS)
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    sampling = pb.SamplingOptions(**{k: v for k, v in options.items() if k in SAMPLING_FIELDS and v is not None})
    stopping = pb.StoppingOptions(
        stop=list(stop), **{k: v for k, v in options.items() if k in STOPPING_FIELDS and v is not None}
    )
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling, stopping=stopping)
    if messages is not None:
        request.chat.CopyFrom(pb.ChatInput(messages=[pb.ChatMessage(**m) for m in messages]))
    if prompt is not None:
        request.prompt = prompt
    if token_ids is not None:
        request.tokens.CopyFrom(pb.TokenInput(ids=list(token_ids)))
    return request


class Client:
    def __init__(
        self, target: str = "localhost:50051", token: str | None = None, root_certificates: bytes | None = None
    ) -> None:
        if root_certificates is not None:
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates))
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()

    def generate(self, timeout: float | None = None, **kwargs) -> pb.GenerateResponse:
        return self.stub.Generate(build_request(**kwargs), timeout=timeout, metadata=self.metadata)

    def stream(self, timeout: float | None = None, **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.GenerateStream(build_request(**kwargs), timeout=timeout, metadata=self.metadata)

    def stream_chat(self, messages: Sequence[dict[str, str]], **kwargs) -> Iterator[str]:
        for chunk in self.stream(messages=messages, **kwargs):
            yield chunk.text_delta

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.client", description="Stream a chat reply.")
    p.add_argument("prompt", nargs="*", help="the user message (read from stdin when absent)")
    p.add_argument("--target", default="localhost:50051")
    p.add_argument("--system", help="a system message")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--token", help="bearer token")
    p.add_argument("--ca-cert", help="CA certificate (PEM) for a TLS server")
    args = p.parse_args(argv)
    text = " ".join(args.prompt) or sys.stdin.read()
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text.strip()}
    ]
    certs = Path(args.ca_cert).read_bytes() if args.ca_cert else None
    try:
        with Client(args.target, args.token, certs) as client:
            for delta in client.stream_chat(
                messages,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
            ):
                print(delta, end="", flush=True)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
