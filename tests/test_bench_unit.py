"""The benchmark's arithmetic and report, on hand-made results (no model, no timing)."""

from pathlib import Path

import pytest

from bench import grpc_ab, report


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
                    "threads": {"ok": True, "a": {"num_threads": 1}, "b": {"num_threads": 2}, "workloads": [workload]},
                    "dq_group_size": {"ok": False, "error": "it broke"},
                },
            }
        },
    }


def test_report_shows_grpc_cost_and_tuning_answers(tmp_path: Path):
    report.write(_results(), tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    assert "| 1 | 100.0 | 97.0 | 0.970 |" in text
    assert "| threads | num_threads=1 | num_threads=2 | burst of 1 | 50.0 | 60.0 | 1.20 | 100 / 90 | - / - |" in text
    assert "dq_group_size | failed: it broke" in text
