"""bench.capacity: the seeded workload, the capacity search and a level's verdict without a model; one short
level against our server on SmolLM2 through the benchmark's own HTTP client."""

import asyncio
import random
import re
import shutil
import time
from pathlib import Path

import pytest

from bench import capacity, capacity_report
from bench.chat_load import ChatClient, cached_of, probe_prediction, run_level, served_model, session_number
from bench.workload import DOCUMENT_TOKENS, REPLY_TOKENS, Workload, arrivals

CJK = re.compile(r"[\u4e00-\u9fff]")


def count(text: str) -> int:
    """A stand-in tokenizer: a CJK character, a run of letters or digits, or a punctuation mark is a token."""
    return len(re.findall(r"[\u4e00-\u9fff]|[A-Za-z0-9]+|[^\sA-Za-z0-9\u4e00-\u9fff]", text))


def test_sessions_are_a_function_of_seed_and_number():
    a, b = Workload(3, count), Workload(3, count)
    assert [a.session(i) for i in range(5)] == [b.session(i) for i in range(5)]
    assert a.session(0) != a.session(1)
    assert Workload(4, count).session(0) != a.session(0)


def test_sessions_paste_a_document_then_edit_and_write_within_the_ranges():
    w = Workload(1, count, think_s=5.0)
    sessions = [w.session(i) for i in range(60)]
    assert {s.lang for s in sessions} == {"en", "zh"}
    kinds = set()
    for s in sessions:
        assert DOCUMENT_TOKENS[0] <= s.document_tokens <= DOCUMENT_TOKENS[1], s.name
        assert 3 <= len(s.turns) <= 6
        assert s.turns[0].kind == "paste" and s.turns[0].think_s == 0
        assert all(t.kind != "paste" for t in s.turns[1:])
        for t in s.turns:
            kinds.add((t.kind, t.task))
            assert REPLY_TOKENS[0] <= t.max_tokens <= REPLY_TOKENS[1]
            assert bool(CJK.search(t.text)) == (s.lang == "zh")
            if t.kind == "edit":
                assert t.prediction and t.prediction in t.text  # the user's own paragraph
            else:
                assert t.prediction is None
            if t.kind != "paste":
                assert 5.0 / 4 <= t.think_s <= 5.0 * 4
    tasks = {task for _, task in kinds}
    assert {"rewrite", "fix", "translate"} <= tasks and tasks & {"continue", "expand", "draft"}
    assert count(w.system_prompt) > 200  # a shared prefix of a few hundred tokens


def test_users_arrive_over_the_ramp():
    times = arrivals(random.Random(1), 8, 30.0)
    assert times == arrivals(random.Random(1), 8, 30.0)
    assert times[0] == 0 and times == sorted(times) and len(times) == 8
    assert arrivals(random.Random(1), 3, 0) == [0, 0, 0]


class EchoClient:
    """Stands in for a server: each turn takes `seconds` and replies with a fixed text."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.conversations: list[list[dict]] = []

    async def turn(self, messages, turn, result, session_id) -> str:
        self.conversations.append(list(messages))
        await asyncio.sleep(self.seconds)
        result.ttft_s, result.completion_tokens = self.seconds, turn.max_tokens
        return "reply"


def test_a_level_sends_each_user_its_sessions_in_order_with_history_and_stops_on_time():
    workload = Workload(1, count, think_s=0.01, document_tokens=(40, 80), reply_tokens=(6, 12))
    client = EchoClient(0.02)
    turns = asyncio.run(run_level(client, workload, 2, 0.3, 0.05, seed=1))
    # no turn started after the duration (sent_s is rounded to the millisecond: one sent at 0.2996 s reads 0.3)
    assert turns and max(t.sent_s for t in turns) <= 0.3
    # user k's j-th session is the same whatever the server: sent from its first turn on, in order
    expected = {s.name: s for s in (workload.session(session_number(2, k, j)) for k in range(2) for j in range(20))}
    sent: dict[str, list] = {}
    for t in sorted(turns, key=lambda t: t.sent_s):
        sent.setdefault(t.session, []).append((t.kind, t.task))
    assert {workload.session(session_number(2, k, 0)).name for k in range(2)} <= sent.keys()
    for name, kinds in sent.items():
        assert kinds == [(x.kind, x.task) for x in expected[name].turns[: len(kinds)]]
    for messages in client.conversations:  # the system prompt, then user and assistant turns in order
        assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * (len(messages) // 2 - 1) + ["user"]


def test_a_level_runs_on_until_it_has_measured_enough_turns_but_not_past_three_durations():
    workload = Workload(1, count, think_s=0.01, document_tokens=(40, 80), reply_tokens=(6, 12))
    # one user, a turn every 0.05-0.09 s: at most 4 turns by 0.2 s, at least 6 by 0.6 s on an idle machine
    turns = asyncio.run(run_level(EchoClient(0.05), workload, 1, 0.2, 0.0, seed=1, min_turns=5))
    last = max(t.sent_s for t in turns)
    assert last > 0.2 and (len(turns) >= 5 or last > 0.55)  # a busy machine may reach the cap first
    capped = asyncio.run(run_level(EchoClient(0.05), workload, 1, 0.2, 0.0, seed=1, min_turns=10**6))
    assert max(t.sent_s for t in capped) < 0.6 + 0.05


def walk(search: capacity.Search, carries) -> list[int]:
    tried = []
    while (users := search.next()) is not None:
        tried.append(users)
        search.record(users, carries(users))
    return tried


def test_search_climbs_the_ladder_until_a_level_is_missed():
    search = capacity.Search([1, 2, 4, 8, 16], refine=False)
    assert walk(search, lambda n: n <= 5) == [1, 2, 4, 8]
    assert search.capacity == 4


def test_search_refines_between_the_last_carried_and_the_first_missed():
    search = capacity.Search([1, 2, 4, 8, 16], refine=True)
    assert walk(search, lambda n: n <= 5) == [1, 2, 4, 8, 6, 5]
    assert search.capacity == 5


def test_search_capacity_is_zero_when_one_user_is_too_many_and_the_top_when_all_are_carried():
    none = capacity.Search([1, 2, 4], refine=True)
    assert walk(none, lambda n: False) == [1] and none.capacity == 0
    every = capacity.Search([4, 1, 2], refine=True)
    assert walk(every, lambda n: True) == [1, 2, 4] and every.capacity == 4


def test_search_from_a_start_climbs_from_there_and_a_miss_at_the_start_refines_below_it():
    search = capacity.Search([1, 2, 4, 8, 16, 32], refine=True, start=12)
    assert walk(search, lambda n: n <= 22) == [12, 16, 32, 24, 20, 22, 23]
    assert search.capacity == 22
    low = capacity.Search([1, 2, 4, 8, 16], refine=True, start=12)
    assert walk(low, lambda n: n <= 5) == [12, 6, 3, 4, 5] and low.capacity == 5


def test_starts_from_the_command_line_are_checked():
    assert capacity.starts(["genai CB=12", "ovserve plain=16"], 48) == {"genai CB": 12, "ovserve plain": 16}
    for bad in ["genai CB", "=4", "genai CB=0", "genai CB=49", "genai CB=x"]:
        with pytest.raises(SystemExit, match="SYSTEM=USERS"):
            capacity.starts([bad], 48)


def test_a_start_may_name_a_replicated_system_only_when_replicas_are_run():
    known = capacity.systems(Path("m"), quick=False, with_llama=False)
    chosen = capacity.choose(known, "ovserve plain,genai CB", 3, {"ovserve plain x3": 8, "genai CB": 12})
    assert [s.name for s in chosen] == ["ovserve plain", "ovserve plain x3", "genai CB"]
    with pytest.raises(SystemExit, match="ovserve plain x3"):
        capacity.choose(known, "ovserve plain,genai CB", 1, {"ovserve plain x3": 8})
    with pytest.raises(SystemExit, match="llama"):
        capacity.choose(known, "ovserve plain", 1, {"llama-server Q8_0": 2})


def test_search_with_every_level_runs_the_whole_ladder_and_counts_only_below_the_first_miss():
    search = capacity.Search([1, 2, 4, 8], refine=True, every=True)
    assert walk(search, lambda n: n != 2) == [1, 2, 4, 8]  # no refining; 4 and 8 carried above a miss
    assert search.capacity == 1


def test_ranges_and_replica_counts_from_the_command_line_are_checked():
    assert capacity.span("300,600") == (300, 600) and capacity.span("5,5") == (5, 5)
    for text in ("a,b", "1,2,3", "0,5", "5,3", "-1,2", "", "1.5,3"):
        with pytest.raises(SystemExit, match="a range is LOW,HIGH with 0 < LOW <= HIGH"):
            capacity.span(text)
    with pytest.raises(SystemExit):
        capacity.main(["--replicas", "0"])


def turn(kind="edit", ttft=0.5, tpot=0.05, warmup=False, status="ok", cached=None):
    return {
        "kind": kind, "status": status, "warmup": warmup, "ttft_s": ttft, "tpot_s": tpot, "gaps_s": [tpot],
        "prompt_tokens": 1000, "cached_tokens": cached, "completion_tokens": 100, "accepted_prediction_tokens": None,
    }  # fmt: skip


def test_a_level_is_carried_when_every_p95_meets_its_target_over_measured_turns():
    targets = capacity.Targets(ttft_s=1.0, paste_ttft_s=5.0, tpot_s=0.1)
    turns = [turn() for _ in range(19)] + [turn("paste", ttft=4.0), turn(ttft=30, warmup=True)]
    s = capacity.summarize(turns, 10.0, targets)
    assert s["carried"] and s["turns"] == 20 and s["warmup_turns"] == 1
    assert s["p95"]["paste_ttft_s"] == 4.0 and s["samples"]["paste_ttft"] == 1
    assert s["output_tokens_per_s"] == pytest.approx(21 * 100 / 10.0)
    assert s["prompt_tokens_reused"] is None  # no turn reported reuse
    slow_paste = capacity.summarize([*turns, turn("paste", ttft=9.0), turn("paste", ttft=9.0)], 10.0, targets)
    assert slow_paste["missed"] == ["paste_ttft_s"]
    slow_pace = capacity.summarize([turn(tpot=0.2) for _ in range(20)], 10.0, targets)
    assert slow_pace["missed"] == ["tpot_s"]


def test_a_failed_turn_or_no_measured_turn_misses_the_level():
    targets = capacity.Targets()
    failed = capacity.summarize([turn(), turn(status="http 500: boom")], 1.0, targets)
    assert not failed["carried"] and failed["missed"] == ["errors"] and failed["error_samples"] == ["http 500: boom"]
    empty = capacity.summarize([turn(warmup=True)], 1.0, targets)
    assert not empty["carried"] and "no turn measured" in empty["missed"]
    reused = capacity.summarize([turn(cached=600), turn(cached=400)], 1.0, targets)
    assert reused["prompt_tokens_reused"] == 1000 and reused["prompt_tokens"] == 2000


def test_reused_prompt_tokens_come_from_openai_usage_or_llama_timings():
    assert cached_of({"prompt_tokens_details": {"cached_tokens": 7}}, {"cache_n": 3}) == 7
    assert cached_of({"prompt_tokens": 9}, {"cache_n": 3}) == 3
    assert cached_of({"prompt_tokens": 9}, None) is None


def test_report_leads_with_users_carried(tmp_path):
    level = {
        "users": 2, "peak_rss_bytes": 7e8, "loadavg": [1.0, 1.0, 1.0],
        "summary": capacity.summarize([turn(cached=500), turn("paste")], 5.0),
    }  # fmt: skip
    results = {
        "started": "s", "finished": "f", "quick": True, "threads": 2, "model": "m", "llama_server": "not built",
        "machine": {"cpu_model": "cpu", "usable_cpus": 2, "isa_flags": ["avx2"]}, "versions": {},
        "plan": {"ladder": [1, 2], "refine": False, "duration_s": 5, "ramp_s": 1, "think_s": 1, "seed": 1,
                 "prediction": True, "targets": vars(capacity.TARGETS)},
        "systems": {"a": {"settings": "x", "prediction": "refused", "capacity": 2, "levels": [level]}},
    }  # fmt: skip
    capacity_report.write(results, tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    assert "| a | **2** | 2 users |" in text and "50% of 1,000" in text and "avx2" in text
    assert (tmp_path / "ttft.png").stat().st_size > 0


@pytest.mark.slow  # 49 s on a 2-core host loaded ~8x by other work; a paste of ~400 tokens dominates
def test_one_level_against_our_server(smol_server, smollm2_ir):
    """Two users through the benchmark's client: every turn streamed, counted and timed; the workload's
    lengths hold with SmolLM2's own tokenizer."""
    tokens = capacity.token_counter(smollm2_ir)
    real = Workload(1, tokens)
    assert all(500 <= real.session(i).document_tokens <= 1500 for i in range(4))
    workload = Workload(1, tokens, think_s=0.2, document_tokens=(40, 80), reply_tokens=(6, 12))
    url = smol_server.url

    async def model_and_prediction() -> tuple[str, str]:
        client = ChatClient(url, False, False)
        try:
            client.model = await served_model(client)
            return client.model, await probe_prediction(client, workload)
        finally:
            await client.close()

    model, prediction = asyncio.run(model_and_prediction())
    assert prediction in ("refused", "accepted")  # our server never ignores a field it does not serve
    plan = capacity.Plan([2], False, duration_s=3.0, ramp_s=0.5, think_s=0.2, seed=1, prediction=True)
    started = time.monotonic()
    level = capacity.measure(url, None, workload, 2, plan, prediction == "accepted", True, model)
    assert time.monotonic() - started < 120
    turns = level["turns"]
    assert turns and all(t["status"] == "ok" for t in turns), [t["status"] for t in turns]
    assert {t["kind"] for t in turns} >= {"paste"}
    for t in turns:
        assert t["ttft_s"] > 0 and t["prompt_tokens"] > 0 and t["cached_tokens"] == 0  # this server: no prefix cache
        assert 6 <= t["completion_tokens"] <= 12  # ignore_eos: the turn's max_tokens
    assert level["summary"]["turns"] + level["summary"]["warmup_turns"] == len(turns)


def one_level(served, workload: Workload, users: int, plan, session_header: bool) -> tuple[dict, str]:
    """Once the server serves: what it does with `prediction`, then one level (prediction sent as the plan
    says); the server is stopped however that ends."""
    try:
        served.wait(300)
        model, prediction = capacity.prepare(served.url, workload)
        level = capacity.measure(served.url, served.pids, workload, users, plan, plan.prediction, session_header, model)
        return level, prediction
    finally:
        served.stop()


@pytest.mark.slow  # loads openvino-genai's pipeline in a server of its own
def test_genai_behind_the_same_client(smollm2_ir, tmp_path):
    """genai's pipeline behind bench.genai_server answers the benchmark's client as the other servers do:
    streamed text, usage with exactly max_tokens under ignore_eos, `prediction` ignored."""
    workload = Workload(2, capacity.token_counter(smollm2_ir), 0.2, document_tokens=(40, 80), reply_tokens=(6, 12))
    served = capacity.Served(capacity.System("genai CB", "genai", "test"), smollm2_ir, tmp_path, slots=2)
    plan = capacity.Plan([1], False, duration_s=2.0, ramp_s=0.0, think_s=0.2, seed=2, prediction=True)
    level, prediction = one_level(served, workload, 1, plan, session_header=False)
    assert prediction == "ignored"
    turns = level["turns"]
    assert turns and all(t["status"] == "ok" for t in turns), [t["status"] for t in turns]
    for t in turns:
        assert t["ttft_s"] > 0 and t["prompt_tokens"] > 0 and 6 <= t["completion_tokens"] <= 12
        assert t["cached_tokens"] is None  # the pipeline does not say what it reused
    assert level["peak_rss_bytes"] > 100e6


@pytest.mark.slow  # two replicas and HAProxy
def test_replicas_behind_haproxy_keep_a_session_on_one_replica(smollm2_ir, tmp_path):
    """The replicas variant of a system: two replicas behind the project's HAProxy recipe, the cores and KV
    budget split between them; a session's later turns find their history cached (hashed to one replica),
    and memory counts every replica."""
    pytest.importorskip("psutil")
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (make system-packages)")
    workload = Workload(3, capacity.token_counter(smollm2_ir), 0.1, document_tokens=(40, 80), reply_tokens=(6, 8))
    plain = capacity.System("ovserve plain", "ovserve", "test")
    system = capacity.behind_haproxy(plain, 2)
    assert system.name == "ovserve plain x2" and system.session_header and "2 replicas" in system.settings
    served = capacity.Served(system, smollm2_ir, tmp_path, slots=2)
    plan = capacity.Plan([2], False, duration_s=4.0, ramp_s=0.0, think_s=0.1, seed=3, prediction=False)
    level, _ = one_level(served, workload, 2, plan, session_header=True)
    assert len(served.pids) == 2 and served.balancer is not None
    turns = level["turns"]
    assert turns and all(t["status"] == "ok" for t in turns), [t["status"] for t in turns]
    # a session's later turn found its history (the previous turn's prompt, up to two blocks: a hit that would
    # leave the last token of a prompt piece to compute alone gives a block back, core/feed.py) on the replica
    # it went to: with round robin, every other turn would find only the system prompt there
    previous: dict[str, int] = {}
    followed = 0
    for t in turns:
        if t["session"] in previous:
            assert t["cached_tokens"] >= previous[t["session"]] - 64, t
            followed += 1
        previous[t["session"]] = t["prompt_tokens"]
    assert followed
    assert level["peak_rss_bytes"] > 2 * 100e6
    assert all(p.poll() is not None for p in [r.proc for r in served.replicas])
