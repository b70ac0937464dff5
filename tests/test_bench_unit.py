"""The benchmark's arithmetic and report, on hand-made results (no model, no timing)."""

from dataclasses import replace
from pathlib import Path

import pytest

from bench import grpc_ab, grpc_load, replicas, report, revisions, tune, workers
from service.config import parse_args
from service.core.config import EngineConfig
from service.core.stats import EngineStats


def _pair(inproc_tps, grpc_tps, inproc_cpu, server_cpu, client_cpu):
    return {
        "inproc": {"tokens_per_s": inproc_tps, "cpu_s_per_token": inproc_cpu},
        "grpc": {"tokens_per_s": grpc_tps, "cpu_s_per_token": server_cpu, "client_cpu_s_per_token": client_cpu},
    }


def test_grpc_ab_summary_takes_per_pair_ratios_and_cpu_shares():
    pairs = [
        _pair(100, 95, 0.010, 0.0104, 0.0001),
        _pair(80, 80, 0.012, 0.0120, 0.0001),
        _pair(90, 81, 0.011, 0.0112, 0.0001),
    ]
    s = grpc_ab.summarize(pairs)
    assert s["throughput_ratio"] == pytest.approx(0.95)  # median of 0.95, 1.0, 0.9
    assert s["inproc_tokens_per_s"] == 90
    assert s["cpu_cost"] == pytest.approx((0.0112 + 0.0001) / 0.011 - 1)
    assert s["server_cpu_cost"] == pytest.approx(0.0112 / 0.011 - 1)


def _results() -> dict:
    pairs = [_pair(100, 97, 0.01, 0.0102, 0.0001)]
    workload = {
        "workload": "burst of 1",
        "a_tokens_per_s": 50.0,
        "b_tokens_per_s": 60.0,
        "b_over_a": 1.2,
        "a_ttft_p50_s": 0.1,
        "b_ttft_p50_s": 0.09,
    }
    return {
        "started": "then",
        "machine": {"cpu_model": "x"},
        "models": {
            "m": {
                "dir": "models/m",
                "weight_bytes": 1e8,
                "embedding_bytes": 1e7,
                "prompt_tokens_mean": 100,
                "max_new_tokens": 128,
                "budget": {"kv_cache_gb": 1.0},
                "rounds": [],
                "grpc": {
                    "overhead": {
                        "ok": True,
                        "max_new_tokens": 128,
                        "runs": {"1": {"pairs": pairs, **grpc_ab.summarize(pairs)}},
                    },
                },
                "tuning": {
                    "threads": {"ok": True, "a": {"threads": 1}, "b": {"threads": 2}, "workloads": [workload]},
                    "dq_group_size": {"ok": False, "error": "it broke"},
                },
            }
        },
    }


def test_report_shows_grpc_cost_and_tuning_answers(tmp_path: Path):
    report.write(_results(), tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    assert "| 1 | 100.0 | 97.0 | 0.970 |" in text
    assert "| threads | threads=1 | threads=2 | burst of 1 | 50.0 | 60.0 | 1.20 | 100 / 90 | - / - |" in text
    assert "dq_group_size | failed: it broke" in text


def test_budget_is_the_engine_defaults_with_two_threads_and_survives_a_spec():
    assert replace(workers.BUDGET, threads=None) == EngineConfig()
    assert workers.BUDGET.threads == 2
    spec = {"budget": workers.budget_dict(replace(workers.BUDGET, kv_cache_gb=2.0))}
    assert workers.budget_of(spec) == replace(workers.BUDGET, kv_cache_gb=2.0)


def test_server_flags_give_the_server_the_same_engine_config():
    config = replace(workers.BUDGET, kv_cache_gb=2.0, enable_prefix_caching=False, dq_group_size=64)
    assert parse_args(["--model", "m", *grpc_load.server_flags(config)], env={}).engine == config


def test_tuning_knobs_are_engine_settings():
    for a, b in tune.KNOBS.values():
        EngineConfig(**a)
        EngineConfig(**b)


def test_engine_thread_seconds_are_deltas_of_the_engine_counters():
    before = EngineStats(num_steps=3, execute_seconds_total=1.0, step_seconds_total=1.5)
    after = EngineStats(
        num_steps=10,
        schedule_seconds_total=0.1,
        execute_seconds_total=3.0,
        sample_seconds_total=0.2,
        update_seconds_total=0.05,
        step_seconds_total=4.0,
    )
    t = workers.engine_thread_seconds(before, after)
    assert t == pytest.approx({"schedule": 0.1, "execute": 2.0, "sample": 0.2, "update": 0.05, "step": 2.5, "steps": 7})


def _ours_round(thread_s: dict) -> dict:
    return {
        "ours": {
            "ok": True,
            "runs": [{"concurrency": 1, "wall_s": 2.0, "tokens_per_s": 50.0, "engine_thread_s": thread_s}],
        }
    }


@pytest.mark.parametrize("update_key", ["update", "complete"])  # "complete": results.json from before EngineStats
def test_report_profiles_the_engine_thread(tmp_path: Path, update_key: str):
    results = _results()
    thread_s = {"execute": 1.0, "sample": 0.1, "schedule": 0.02, update_key: 0.02, "step": 1.2}
    results["models"]["m"]["rounds"] = [_ours_round(thread_s)]
    report.write(results, tmp_path)
    assert "| 1 | 50% | 5% | 2% | 3% | 40% |" in (tmp_path / "REPORT.md").read_text()


def test_speculative_summary_pairs_each_engine_with_its_own_plain_run():
    from bench import speculative

    rates = {"ovserve": [10, 20], "ovserve+lookup": [30, 30], "genai": [10, 10], "genai+lookup": [20, 40]}
    replies = {
        "ovserve": [[1, 2], [3]],
        "ovserve+lookup": [[1, 2], [4]],
        "genai": [[5], [6]],
        "genai+lookup": [[5], [6]],
    }
    s = speculative.summarize(rates, replies)
    assert s["ratios"]["ovserve+lookup / ovserve"] == pytest.approx(2.25)  # median of 3.0 and 1.5
    assert s["ratios"]["genai+lookup / genai"] == pytest.approx(3.0)
    assert s["ratios"]["ovserve+lookup / genai+lookup"] == pytest.approx((1.5 + 0.75) / 2)
    assert s["identical_greedy_replies"] == {"ovserve+lookup == ovserve": "1/2", "genai+lookup == genai": "2/2"}
    assert all(len(p) > 0 for p in map(speculative.run.load_prompts, speculative.WORKLOADS.values()))


def test_speculative_rounds_take_turns_in_alternating_order_and_keep_each_engines_replies():
    from bench import speculative

    turns: list[str] = []

    def engine(name: str) -> speculative.Serve:
        def serve(prompts: list[list[int]], streams: int, max_new: int) -> list[list[int]]:
            turns.append(name)
            return [[len(name), *p] for p in prompts]

        return serve

    out = speculative.run_streams({"a": engine("a"), "bb": engine("bb")}, [[1], [2], [3]], 1, 3, 4)
    assert turns == ["a", "bb", "bb", "a", "a", "bb"]
    assert out["replies"]["a"] == [[1, 1], [1, 2], [1, 3]]
    assert out["replies"]["bb"] == [[2, 1], [2, 2], [2, 3]]
    assert all(len(v) == 3 for v in out["rates"].values())


def test_history_from_the_store_is_the_end_of_what_was_found():
    """A prefix is found in RAM first, then on disk, then in the fleet's store: the fetched tokens are the end of
    the cached ones, and only what falls within the history (the previous turn's prompt) counts."""

    def turn(cached: int, remote: int, history: int = 500) -> replicas.Turn:
        return replicas.Turn(600, cached, 16, 0.1, history, remote)

    assert replicas.share_of_history([turn(480, 480)], remote_only=True) == pytest.approx(0.96)
    assert replicas.share_of_history([turn(520, 320)]) == 1.0  # the reply's first tokens are no history
    assert replicas.share_of_history([turn(520, 320)], remote_only=True) == pytest.approx(0.6)  # 200 from RAM
    assert replicas.share_of_history([turn(520, 0)], remote_only=True) == 0
    assert replicas.share_of_history([turn(0, 0), turn(500, 250)]) == pytest.approx(0.5)
    assert replicas.share_of_history([turn(600, 40)], remote_only=True) == 0  # RAM held the whole history


def test_revisions_reads_server_specs_and_extracts_a_revision(tmp_path: Path):
    assert revisions.server_spec("old=599bcb7") == ("old", "599bcb7", "")
    assert revisions.server_spec("fast=.:--no-deterministic --max-num-batched-tokens 512") == (
        "fast",
        ".",
        "--no-deterministic --max-num-batched-tokens 512",
    )
    for bad in ("old", "=HEAD", "old="):
        with pytest.raises(ValueError, match="NAME=REV"):
            revisions.server_spec(bad)
    tree = revisions.extract("HEAD", tmp_path)
    assert (tree / "service" / "__main__.py").is_file() and (tree / "service/api/ovserve/v1/ovserve_pb2.py").is_file()
    assert revisions.extract("HEAD", tmp_path) == tree  # a second server of the same revision shares the tree
