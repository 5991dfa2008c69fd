"""The online serving benchmark runs (quick mode) and reports both systems with exact token counts.

No timing is asserted: the targets live in the benchmark's own output (benchmarks/results/serving.json).
The quick run starts a real cluster (gateway, scheduler, detokenizer processes) on the tiny model.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from radixserve.cli import build_parser

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"


@pytest.fixture(scope="module")
def serving():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_workload_is_seeded_poisson_and_avoids_special_ids(serving):
    a = serving.build_workload(200, 4.0, (8, 16), (2, 5), 2048, seed=1)
    assert a == serving.build_workload(200, 4.0, (8, 16), (2, 5), 2048, seed=1)
    assert all(min(r["input_ids"]) >= serving.SPECIAL_IDS for r in a)
    assert all(8 <= len(r["input_ids"]) <= 16 and 2 <= r["output_len"] <= 5 for r in a)
    arrivals = [r["arrival"] for r in a]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert 0.15 < arrivals[-1] / 199 < 0.4  # mean gap ~ 1 / rate
    assert all(r["arrival"] == 0 for r in serving.build_workload(5, math.inf, (8, 8), (2, 2), 64, seed=0))


def test_itl_spreads_a_multi_token_event_over_its_tokens(serving):
    assert serving.itl_samples([1.0, 1.5, 2.5], [1, 1, 2]) == [0.5, 0.5, 0.5]


def test_cli_parses_bench_serving_flags():
    args = build_parser().parse_args(["bench", "serving", "--quick", "--rates", "2", "inf", "--threads", "1"])
    assert args.quick and args.rates == ["2", "inf"] and args.threads == 1
    assert args.func.__name__ == "_cmd_bench_serving"


@pytest.mark.timeout(240)
def test_quick_run_reports_both_systems_with_exact_token_counts(serving, tmp_path):
    assert serving.main(["--quick", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "serving.png").stat().st_size > 0
    data = json.loads((tmp_path / "serving.json").read_text())
    results = data["results"]
    assert set(results) == {"served", "inprocess"}
    rates = data["config"]["rates"]
    assert rates
    for rate in rates:
        wl = data["config"]["workloads"][rate]
        for system in ("served", "inprocess"):
            entry = results[system]["rates"][rate]
            s = entry["summary"]
            assert s["completed"] == wl["num_requests"] and s["failed"] == 0, (system, rate, s)
            assert s["all_exact"] and s["output_tokens"] == wl["output_tokens"]
            assert len(entry["requests"]) == wl["num_requests"]
            for r in entry["requests"]:
                assert r["ok"] and r["output_tokens"] == r["expected_tokens"]
                assert 0 <= r["ttft"] <= r["e2e"]
            assert s["output_tok_s"] > 0 and s["itl_ms_p50"] >= 0
        assert "output_tok_s_ratio" in data["verdict"]["per_rate"][rate]
    assert data["verdict"]["every_request_exact"]
    assert {"cpu_count", "torch_threads", "python", "torch", "date"} <= set(data["machine"])
