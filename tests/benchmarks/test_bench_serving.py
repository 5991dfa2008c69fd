"""The online serving benchmark runs (quick mode) and reports both systems with exact token counts.

No timing is asserted: the targets live in the benchmark's own output (benchmarks/results/serving.json).
The quick run starts a real cluster (gateway, scheduler, detokenizer processes) on the tiny model.
"""

import itertools
import json
import math
from pathlib import Path

import pytest

from radixserve.bench_index import load_benchmark


@pytest.fixture(scope="module")
def serving():
    return load_benchmark("serving")


def test_workload_is_seeded_poisson_and_avoids_special_ids(serving):
    a = serving.build_workload(200, 4.0, (8, 16), (2, 5), 2048, seed=1)
    assert a == serving.build_workload(200, 4.0, (8, 16), (2, 5), 2048, seed=1)
    assert all(min(r["input_ids"]) >= serving.SPECIAL_IDS for r in a)
    assert all(8 <= len(r["input_ids"]) <= 16 and 2 <= r["output_len"] <= 5 for r in a)
    arrivals = [r["arrival"] for r in a]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert 0.15 < arrivals[-1] / 199 < 0.4  # mean gap ~ 1 / rate
    assert all(r["arrival"] == 0 for r in serving.build_workload(5, math.inf, (8, 8), (2, 2), 64, seed=0))


def test_closed_loop_workload_deals_requests_to_clients_round_robin(serving):
    w = serving.build_closed_workload(3, 4, (8, 16), (2, 5), 2048, seed=7)
    assert w == serving.build_closed_workload(3, 4, (8, 16), (2, 5), 2048, seed=7)
    assert len(w) == 12 and [r["client"] for r in w] == [0, 1, 2] * 4
    assert all(min(r["input_ids"]) >= serving.SPECIAL_IDS and 2 <= r["output_len"] <= 5 for r in w)
    # the KV pool holds any C requests of a closed-loop run at once
    eargs = serving.engine_args([w[:1]], 8, page_size=16, closed=[(3, w)])
    biggest = sorted(len(r["input_ids"]) + r["output_len"] + 16 for r in w)[-3:]
    assert eargs["max_total_tokens"] >= sum(biggest)


def test_closed_loop_repeats_are_fresh_draws_and_summarised_by_their_median(serving):
    seeds = {serving.closed_seed(0, k, rep) for k in range(3) for rep in range(5)}
    assert len(seeds) == 15 and not seeds & {serving.rate_seed(0, k) for k in range(100)}
    runs = [{"itl_ms_p50": x, "completed": 4, "failed": 0, "all_exact": True} for x in (3.0, 1.0, 2.0)]
    m = serving.median_summary(runs)
    assert m == {"itl_ms_p50": 2.0, "completed": 12, "failed": 0, "all_exact": True}
    assert not serving.median_summary([*runs[:2], {**runs[2], "all_exact": False}])["all_exact"]


def test_itl_spreads_a_multi_token_event_over_its_tokens(serving):
    assert serving.itl_samples([1.0, 1.5, 2.5], [1, 1, 2]) == [0.5, 0.5, 0.5]


def test_bench_serving_parses_its_flags(serving):
    args = serving.parse_args(
        ["--quick", "--rates", "2", "inf", "--threads", "1", "--concurrency", "1", "4"]
        + ["--requests-per-client", "3"]
    )
    assert args.quick and args.rates == [2.0, math.inf] and args.threads == 1
    assert args.concurrency == [1, 4] and args.requests_per_client == 3


@pytest.fixture(scope="module")
def quick_run(serving, tmp_path_factory):
    """One ``--quick`` run for every test that reads its output (it starts a real cluster)."""
    out = tmp_path_factory.mktemp("serving")
    assert serving.main(["--quick", "--out", str(out)]) == 0
    return out


@pytest.mark.timeout(240)
def test_quick_run_reports_both_systems_with_exact_token_counts(quick_run):
    assert (quick_run / "serving.png").stat().st_size > 0
    data = json.loads((quick_run / "serving.json").read_text())
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
    conc = data["config"]["concurrency"]
    assert len(conc) == 1  # quick covers one concurrency
    repeats = data["config"]["closed_loop_repeats"]
    assert repeats == 1  # quick runs each concurrency once
    for c in conc:
        wls = data["config"]["closed_loop_workloads"][c]
        assert len(wls) == repeats
        for system in ("served", "inprocess"):
            entry = results[system]["concurrency"][c]
            assert len(entry["repeats"]) == repeats
            for wl, run in zip(wls, entry["repeats"], strict=True):
                assert wl["num_requests"] == int(c) * data["config"]["requests_per_client"]
                s = run["summary"]
                assert s["completed"] == wl["num_requests"] and s["failed"] == 0, (system, c, s)
                assert s["all_exact"] and s["output_tokens"] == wl["output_tokens"]
                assert len(run["requests"]) == wl["num_requests"]
                for i, r in enumerate(run["requests"]):
                    assert r["ok"] and r["output_tokens"] == r["expected_tokens"]
                    assert r["client"] == i % int(c) and 0 <= r["ttft"] <= r["e2e"]
                # each client's requests ran back to back, never overlapping
                for j in range(int(c)):
                    mine = run["requests"][j :: int(c)]
                    for a, b in itertools.pairwise(mine):
                        assert b["arrival"] >= a["arrival"] + a["e2e"] - 1e-6
                assert s["output_tok_s"] > 0 and s["tpot_ms_p50"] >= 0 and s["itl_ms_p50"] >= 0
            assert entry["summary"]["itl_ms_p50"] == entry["repeats"][0]["summary"]["itl_ms_p50"]
        v = data["verdict"]["per_concurrency"][c]
        assert {"tpot_ms_p50_added", "itl_ms_p50_added", "output_tok_s_ratio"} <= set(v)
        assert len(v["repeats"]) == repeats
    assert "closed_loop_max_tpot_ms_p50_added" in data["verdict"]
    assert data["verdict"]["every_request_exact"]
    assert {"cpu_count", "torch_threads", "python", "torch", "date"} <= set(data["machine"])


def _keys(report: dict) -> dict[str, set[str]]:
    """The report's keys, and one level down those of its dict-valued entries."""
    return {"": set(report)} | {k: set(v) for k, v in report.items() if isinstance(v, dict)}


@pytest.mark.timeout(240)
def test_quick_run_has_the_key_structure_of_the_committed_full_run(quick_run):
    # A quick run lacks none of the full run's keys: fewer rates and concurrencies, the same report.
    full = json.loads((Path(__file__).parents[2] / "benchmarks/results/serving.json").read_text())
    quick = json.loads((quick_run / "serving.json").read_text())
    assert _keys(quick) == _keys(full)
