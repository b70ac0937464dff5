"""Users of a writing assistant, driven against any OpenAI-compatible server: the one client of bench.capacity.

Every system gets the same HTTP requests from this code: POST /v1/chat/completions, streamed, greedy
(temperature 0), `max_tokens` from the workload with `ignore_eos` (every system writes the same number of
tokens a turn), `stream_options.include_usage`, the conversation's whole history every turn (as an OpenAI
client sends it), and optionally an `x-session-id` header and, on edit turns, `prediction`.

A level is `users` users arriving over `ramp_s` seconds (a Poisson process); each runs sessions one after
another, pausing its think time before each turn, and starts no new turn after `duration_s` (or, while fewer
than `min_turns` turns are measured, after three times that: a slow server still gets a sample). Turns sent
before the last user arrived are warm-up: they are kept, marked, and left out of the level's figures.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from bench.workload import Turn, Workload, arrivals

if TYPE_CHECKING:
    import httpx

TIMEOUT_S = 600
KEEP_ALIVE_S = 2.0


@dataclass
class TurnResult:
    session: str
    kind: str
    task: str
    sent_s: float  # since the level started
    warmup: bool
    status: str = "ok"  # "ok", or what went wrong ("http 400: ...", an exception's name)
    ttft_s: float | None = None
    tpot_s: float | None = None  # (last token - first token) / (tokens - 1): the reply's pace
    gaps_s: list[float] = field(default_factory=list)  # between chunks that carried text
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server reused, where it reports them
    completion_tokens: int | None = None
    prediction_sent: bool = False
    accepted_prediction_tokens: int | None = None
    end_s: float | None = None


def cached_of(usage: dict | None, timings: dict | None) -> int | None:
    """Reused prompt tokens: OpenAI's usage.prompt_tokens_details.cached_tokens, else llama.cpp's timings.cache_n."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    if timings and timings.get("cache_n") is not None:
        return int(timings["cache_n"])
    return None


class ChatClient:
    """One server's OpenAI endpoint; `prediction` and `session_header` say what the turns carry."""

    def __init__(self, base_url: str, prediction: bool, session_header: bool, model: str = "default") -> None:
        import httpx

        # An idle connection is dropped well before any server closes it (uvicorn after 5 s, as httpx's own
        # default): reusing one at the moment the server closes it would fail a turn for the client's sake (the
        # likely cause of one turn genai's front lost with a ReadError, docs/BENCH.md).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEP_ALIVE_S)
        self.http = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=TIMEOUT_S)
        self.prediction = prediction
        self.session_header = session_header
        self.model = model

    async def close(self) -> None:
        await self.http.aclose()

    def body(self, messages: list[dict], turn: Turn, ignore_eos: bool = True) -> dict:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": turn.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        if self.prediction and turn.prediction is not None:
            body["prediction"] = {"type": "content", "content": turn.prediction}
        return body

    async def _send(self, body: dict, headers: dict) -> httpx.Response:
        """The turn's POST, its response streamed; sent again once if the server closed the connection without
        answering, as the openai SDK does (llama-server's HTTP server did so to a few turns a run; the time to the
        first token counts from the first try)."""
        import httpx

        for attempt in (1, 2):
            request = self.http.build_request("POST", "/v1/chat/completions", json=body, headers=headers)
            try:
                return await self.http.send(request, stream=True)
            except httpx.RemoteProtocolError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def turn(self, messages: list[dict], turn: Turn, result: TurnResult, session_id: str) -> str:
        """Sends one turn, fills `result` in; the reply's text."""
        body = self.body(messages, turn)
        result.prediction_sent = "prediction" in body
        headers = {"x-session-id": session_id} if self.session_header else {}
        text: list[str] = []
        times: list[float] = []
        usage = timings = None
        started = time.perf_counter()
        response = await self._send(body, headers)
        try:
            if response.status_code != 200:
                result.status = (
                    f"http {response.status_code}: {(await response.aread())[:200].decode(errors='replace')}"
                )
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        times.append(time.perf_counter())
                        text.append(piece)
        finally:
            await response.aclose()
        result.end_s = time.perf_counter() - started
        if times:
            result.ttft_s = times[0] - started
            result.gaps_s = [round(b - a, 5) for a, b in zip(times, times[1:], strict=False)]
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens")
            result.completion_tokens = usage.get("completion_tokens")
            details = usage.get("completion_tokens_details") or {}
            result.accepted_prediction_tokens = details.get("accepted_prediction_tokens")
        result.cached_tokens = cached_of(usage, timings)
        n = result.completion_tokens or len(times)
        if len(times) > 1 and n > 1:
            result.tpot_s = (times[-1] - times[0]) / (n - 1)
        return "".join(text)


async def served_model(client: ChatClient) -> str:
    """The first model the server lists (GET /v1/models), which requests then name."""
    response = await client.http.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def probe_prediction(client: ChatClient, workload: Workload) -> str:
    """What the server does with `prediction`, asked with an edit turn it answers without one: "refused" (an
    error), "accepted" (usage counts predicted tokens) or "ignored" (a reply without such counts)."""
    session = next(s for s in map(workload.session, range(10**6, 10**6 + 50)) if any(t.prediction for t in s.turns))
    turn = next(t for t in session.turns if t.prediction is not None)
    turn = Turn(turn.kind, turn.task, turn.text, 8, turn.prediction, 0.0)
    messages = [{"role": "system", "content": workload.system_prompt}, {"role": "user", "content": turn.text}]
    was = client.prediction
    outcome = {}
    try:
        for with_prediction in (False, True):
            client.prediction = with_prediction
            result = TurnResult(session.name, turn.kind, turn.task, 0.0, True)
            await client.turn(messages, turn, result, "probe")
            outcome[with_prediction] = result
    finally:
        client.prediction = was
    if outcome[False].status != "ok":
        raise RuntimeError(f"the server failed a plain turn: {outcome[False].status}")
    if outcome[True].status != "ok":
        return "refused"
    return "accepted" if outcome[True].accepted_prediction_tokens is not None else "ignored"


def session_number(users: int, user: int, nth: int) -> int:
    """The same sessions for every system at a level: user k's j-th session."""
    return users * 100_000 + user * 100 + nth


async def run_level(
    client: ChatClient,
    workload: Workload,
    users: int,
    duration_s: float,
    ramp_s: float,
    seed: int,
    min_turns: int = 0,
) -> list[TurnResult]:
    """`users` users talking to the server for `duration_s` seconds; every turn's result."""
    starts = arrivals(random.Random(f"{seed}/arrivals/{users}"), users, ramp_s)
    measured_from = starts[-1]
    for k in range(users):  # the sessions users are likely to reach, made before the clock starts
        for j in range(3):
            workload.session(session_number(users, k, j))
    results: list[TurnResult] = []
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    def over() -> bool:
        if now() < duration_s:
            return False
        measured = sum(not r.warmup for r in results)
        return measured >= min_turns or now() >= 3 * duration_s

    async def user(k: int, start: float) -> None:
        await asyncio.sleep(start)
        j = 0
        while not over():
            session = workload.session(session_number(users, k, j))
            j += 1
            messages = [{"role": "system", "content": workload.system_prompt}]
            for turn in session.turns:
                await asyncio.sleep(turn.think_s)
                if over():
                    return
                messages.append({"role": "user", "content": turn.text})
                result = TurnResult(session.name, turn.kind, turn.task, round(now(), 3), now() < measured_from)
                results.append(result)
                try:
                    reply = await client.turn(messages, turn, result, session.name)
                except Exception as exc:  # a dropped connection or a timeout: this session ends
                    result.status = f"{type(exc).__name__}: {exc}"[:200]
                if result.status != "ok":  # the session ends; the user comes back after a pause
                    await asyncio.sleep(max(1.0, workload.think_s))
                    break
                messages.append({"role": "assistant", "content": reply})

    await asyncio.gather(*(user(k, s) for k, s in enumerate(starts)))
    return results


def as_dicts(results: list[TurnResult]) -> list[dict]:
    return [asdict(r) for r in results]
