"""Tool calls end to end, offline: serve a model on free ports, ask it to call the README's weather tool over the
OpenAI-compatible HTTP API, print the raw call as the API returns it, send a result back, print the reply, stop.

    python scripts/tools_demo.py MODEL_DIR [server flags...]     (make tools-demo: the tiny Qwen3 below)

`make tools-demo` runs it on a tiny Qwen3 with random weights, the real Qwen3 vocabulary and Qwen3-4B-Instruct-2507's
chat template: the format, the grammar and the parsing are the real ones, the words are random. Such a model
never chooses to call a tool by itself (tool_choice "auto" gets text); with tool_choice "required" the grammar
makes it write a call whose name is one of the tools and whose arguments are valid against the tool's schema.
A trained Qwen3 instruct model fills the arguments with meaning. Only the standard library: no SDK needed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
READY_SECONDS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return dict(json.load(response))
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"error: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None


def wait_ready(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"error: the server exited with status {server.returncode} (its log is above)")
        try:
            with urllib.request.urlopen(base + "/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"error: the server was not ready within {READY_SECONDS} s")


def show(title: str, value: object) -> None:
    print(f"\n== {title}\n{json.dumps(value, indent=2, ensure_ascii=False)}", flush=True)


def demo(base: str) -> None:
    url = base + "/v1/chat/completions"
    model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))["data"][0]["id"]
    common = {"model": model, "tools": [WEATHER], "max_tokens": 100, "temperature": 0}
    auto = post(url, {**common, "messages": ASK, "max_tokens": 24})["choices"][0]
    show(
        'tool_choice "auto": the model chooses (a random-weight model writes text; finish_reason shows which)',
        {"finish_reason": auto["finish_reason"], "content": auto["message"]["content"]},
    )
    required = post(url, {**common, "messages": ASK, "tool_choice": "required", "parallel_tool_calls": False})
    choice = required["choices"][0]
    show('tool_choice "required": the message as the API returns it', choice["message"])
    call = choice["message"]["tool_calls"][0]
    arguments = json.loads(call["function"]["arguments"])
    print(f"\nparsed: {call['function']['name']}({arguments}); finish_reason {choice['finish_reason']!r}")
    print("(the arguments always match the tool's schema; with random weights their values are random text)")
    result = {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"forecast": "sunny", "celsius": 21})}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, result]
    after = post(url, {**common, "messages": turn, "tool_choice": "none", "max_tokens": 24})["choices"][0]
    show("the tool's result sent back: the model's next reply (random words here)", after["message"])


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    model, flags = argv[0], argv[1:]
    http_port = free_port()
    command = [sys.executable, "-m", "service", "--model", model, "--host", "127.0.0.1"]
    command += ["--port", str(free_port()), "--http-port", str(http_port), "--metrics-port", "0"]
    command += ["--drain-delay-seconds", "0", *flags]
    print("$ " + " ".join(command), flush=True)
    base = f"http://127.0.0.1:{http_port}"
    with subprocess.Popen(command, cwd=ROOT) as server:  # leaving waits for the server to exit
        try:
            wait_ready(base, server)
            demo(base)
        finally:
            server.terminate()  # a drain with nothing in flight: it stops within a second
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
