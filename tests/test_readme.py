"""Every example in README.md, run as written against a real server (`python -m service`, default settings) that
this module starts on free ports with the default model. The examples are read from the README at collection
time: a new or changed example is tested as soon as it is written, with no list here to keep in step.

What runs: every fenced ```sh and ```python block. A sh block is cut into commands (a command goes on past a
trailing backslash or an open quote) and each runs in bash from the project's root, as a reader pastes it; a
python block runs whole in this interpreter (the project's .venv), from the project's root.

The one substitution: the README's addresses name the default ports, and the test's server listens on free ones.
`localhost:50051`, `localhost:8000` and `localhost:9090` become `localhost:` and the server's gRPC, HTTP and
metrics port, and `python -m service.client` without `--target` (whose default is localhost:50051) is given
`--target localhost:<gRPC port>`. Nothing else in an example is changed; OVSERVE_* variables are not passed on.

Success: exit 0 and a reply that parses. Output that starts with `{` is one JSON reply with choices and no error
(a reply under a `response_format` finishes and its content parses as JSON); output that starts with `data:` is
a stream of JSON events with choices and no error, up to `[DONE]`; curl must print one of the two (curl -s
exits 0 on an HTTP error); any other example must print something.

A block can carry a marker, an HTML comment on the line before its fence (GitHub shows nothing):
    <!-- example: skip: REASON -->                 not run; the test fails when no reason is given
    <!-- example: model DIR (make TARGET) -->       run against `python -m service --model DIR` instead, after
                                                    `make TARGET` (which builds DIR, a no-op once built); on the
                                                    default model the block must fail with a 400 (an HTTP error
                                                    that names what is missing), else the marker is stale
A block in any other language must be marked skip."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.servers import free_port

pytestmark = pytest.mark.slow
README = ROOT / "README.md"
RUNNABLE = ("sh", "python")
COMMAND_SECONDS = 300  # a 256-token reply on 2 busy cores, or the openai package's first import
START_SECONDS = 300
README_PORTS = {"grpc": 50051, "http": 8000, "metrics": 9090}
MARKER = re.compile(r"^<!--\s*example:\s*(?P<what>.*?)\s*-->$")
MODEL_MARKER = re.compile(r"^model\s+(?P<dir>\S+)\s+\(make\s+(?P<target>[\w-]+)\)$")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # what follows "example:" in the comment before the fence

    @property
    def skip_reason(self) -> str | None:
        if self.marker is not None and self.marker.startswith("skip"):
            return self.marker.removeprefix("skip").lstrip(": ").strip()
        return None

    @property
    def model(self) -> re.Match[str] | None:
        return MODEL_MARKER.match(self.marker) if self.marker else None


@dataclass(frozen=True)
class Example:
    """One runnable unit: a shell command or a whole python block."""

    block: Block
    line: int  # of its first line, 1-based
    code: str

    @property
    def id(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str) -> list[Block]:
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        marker = MARKER.match(before)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(i + 1, opening.group(1), code, marker.group("what") if marker else None))
        i = end + 1
    return found


def complete(command: str) -> bool:
    """False while a quote is open or the last line ends with a backslash."""
    if command.rstrip("\n").endswith("\\"):
        return False
    try:
        shlex.split(command, comments=True)
    except ValueError:  # "No closing quotation"
        return False
    return True


def commands(block: Block) -> list[Example]:
    found, pending, first = [], "", 0
    for offset, line in enumerate(block.code.splitlines()):
        if not pending:
            first = block.line + 1 + offset
        pending += line + "\n"
        if complete(pending):
            if shlex.split(pending, comments=True):  # not blank, not a comment alone
                found.append(Example(block, first, pending))
            pending = ""
    assert not pending, f"README.md:{first}: a command that never ends: {pending!r}"
    return found


def examples(text: str) -> list[Example]:
    found = []
    for block in blocks(text):
        if block.language == "sh":
            found += commands(block)
        elif block.language == "python":
            found.append(Example(block, block.line + 1, block.code))
    return found


def parametrized() -> list:
    cases = []
    for example in examples(README.read_text()):
        reason = example.block.skip_reason
        marks = [pytest.mark.skip(reason=f"the README says: {reason}")] if reason is not None else []
        cases.append(pytest.param(example, id=example.id, marks=marks))
    return cases


# --- the servers


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OVSERVE_")}


class Server:
    """`python -m service --model DIR` on free ports, as `make serve` starts it; ready once it logs its ready
    line (the last line of a start). Its log is drained on a thread and kept for failure messages."""

    def __init__(self, model: Path) -> None:
        self.ports = {name: free_port() for name in README_PORTS}
        command = [sys.executable, "-m", "service", "--model", str(model), "--port", str(self.ports["grpc"])]
        command += ["--http-port", str(self.ports["http"]), "--metrics-port", str(self.ports["metrics"])]
        self.proc = subprocess.Popen(command, cwd=ROOT, env=clean_env(), stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.start_log: list[str] = []  # up to the ready line
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        if not ready.wait(START_SECONDS) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log[-20:]))

    def _drain(self, ready: threading.Event) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if " serving " in line and "gRPC" in line and not ready.is_set():
                self.start_log = list(self.log)
                ready.set()
        ready.set()  # exited: the waiter sees poll() is not None

    def substitute(self, code: str) -> str:
        for name, port in README_PORTS.items():
            code = code.replace(f"localhost:{port}", f"localhost:{self.ports[name]}")
        if "--target" not in code:
            code = code.replace("-m service.client", f"-m service.client --target localhost:{self.ports['grpc']}")
        return code

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def servers(smollm2_ir):
    """One server per model folder, started when first asked for; the default model's under the key None."""
    started: dict[str | None, Server] = {}

    def get(model: str | None = None) -> Server:
        if model not in started:
            started[model] = Server(smollm2_ir if model is None else ROOT / model)
        return started[model]

    yield get
    for server in started.values():
        server.stop()


def built(block: Block) -> str | None:
    """The model folder a block asks for, built with its make target; None for the default model."""
    if block.model is None:
        return None
    target = block.model.group("target")
    stamps = [arg for stamp in (".installed-runtime", ".installed-convert") for arg in ("-o", f"{sys.prefix}/{stamp}")]
    command = ["make", *stamps, target, f"VENV={sys.prefix}"]  # this venv, taken as installed: never installs
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=clean_env())
    assert result.returncode == 0, f"make {target} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    return block.model.group("dir")


# --- running and judging an example


def run(example: Example, server: Server) -> subprocess.CompletedProcess:
    code = server.substitute(example.code)
    if example.block.language == "sh":
        command = ["bash", "-c", "set -eo pipefail\n" + code]
    else:
        command = [sys.executable, "-c", code]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_SECONDS, env=clean_env())


def check_reply(body: dict, example: Example) -> None:
    assert "error" not in body and body.get("choices"), body
    if "response_format" in example.code:
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        json.loads(choice["message"]["content"])


def check_output(example: Example, out: str) -> None:
    text = out.strip()
    if text.startswith("{"):
        check_reply(json.loads(text), example)
    elif text.startswith("data:"):
        events = [line.removeprefix("data:").strip() for line in text.splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in map(json.loads, events[:-1]):
            assert "error" not in event and "choices" in event, event
    else:
        assert not example.code.lstrip().startswith("curl"), f"curl printed neither JSON nor events: {text[:500]}"
        assert text, "the example printed nothing"


def where(example: Example, server: Server, result: subprocess.CompletedProcess) -> str:
    return (
        f"{example.id} failed (exit {result.returncode}):\n{server.substitute(example.code)}\n"
        f"stdout: {result.stdout[-1500:]}\nstderr: {result.stderr[-1500:]}\nserver log:\n" + "".join(server.log[-10:])
    )


# --- the tests


def test_the_readme_has_examples_and_every_block_is_run_or_says_why_not():
    found = blocks(README.read_text())
    assert sum(b.language in RUNNABLE and b.marker is None for b in found) >= 5  # the parser still finds them
    for block in found:
        where = f"README.md:{block.line} ({block.language or 'no language'})"
        if block.marker is None:
            assert block.language in RUNNABLE, f"{where}: not a sh or python block: mark it skip, with why"
        elif block.skip_reason is not None:
            assert len(block.skip_reason.split()) >= 3, f"{where}: a skip marker must say why: {block.marker!r}"
        else:
            assert block.model is not None, f"{where}: unknown marker {block.marker!r}"
            assert block.language in RUNNABLE, where
            assert re.search(rf"^{block.model.group('target')}:", (ROOT / "Makefile").read_text(), re.M), where


def test_commands_are_cut_where_the_shell_would_cut_them():
    block = Block(1, "sh", "a 'b\nc' \\\n  d  # it's\n# alone\n\ne \"f\"\n", None)
    assert [(e.line, e.code) for e in commands(block)] == [(2, "a 'b\nc' \\\n  d  # it's\n"), (7, 'e "f"\n')]


@pytest.mark.parametrize("example", parametrized())
def test_the_example_runs_as_written(example: Example, servers):
    server = servers(built(example.block))
    result = run(example, server)
    assert result.returncode == 0, where(example, server, result)
    check_output(example, result.stdout)


MODEL_EXAMPLES = [pytest.param(e, id=e.id) for e in examples(README.read_text()) if e.block.model is not None]


@pytest.mark.parametrize("example", MODEL_EXAMPLES)
def test_an_example_for_another_model_says_what_it_needs_on_the_default_model(example: Example, servers):
    server = servers()
    result = run(example, server)
    assert result.returncode != 0, f"{example.id} runs on the default model: its marker is stale"
    assert "Error code: 400" in result.stderr, result.stderr[-1500:]  # the server's clear refusal, not a crash


def test_the_ready_line_comes_last_and_names_every_address_and_the_versions(servers):
    """What the README's quick start promises of the line a reader waits for."""
    server = servers()
    *before, ready = server.start_log
    assert any("listening on" in line for line in before) and any("sample at temperature" in line for line in before)
    places = (
        f"gRPC 127.0.0.1:{server.ports['grpc']}",
        f"OpenAI API http://127.0.0.1:{server.ports['http']}/v1",
        f"playground http://127.0.0.1:{server.ports['http']}/",
        f"metrics http://127.0.0.1:{server.ports['metrics']}/metrics",
        "SmolLM2-135M-Instruct",
        "; ovserve ",
        ", OpenVINO 20",
    )
    for place in places:
        assert place in ready, (place, ready)
