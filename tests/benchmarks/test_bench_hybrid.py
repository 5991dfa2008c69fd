"""The hybrid prefix-caching benchmark runs (a few tiny requests, through the CLI) and reports what
it claims: the same workload with state snapshots on and off and on a dense model, equal outputs,
fewer prompt tokens computed with snapshots, pools free after.

No timing is asserted: the figures live in benchmarks/results/hybrid.json.
"""

import json
from pathlib import Path

from radixserve.cli import main

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "hybrid.json"
TINY = ["--quick", "--num-requests", "4", "--concurrency", "2", "--system-len", "48", "--new-tokens", "2"]


def test_a_tiny_run_reports_prefill_tokens_hit_rates_ttft_and_throughput(tmp_path):
    assert main(["bench", "hybrid", *TINY, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "hybrid.png").stat().st_size > 0
    report = json.loads((tmp_path / "hybrid.json").read_text())
    res, summary = report["results"], report["summary"]
    on, off, dense = res["hybrid_snapshots"], res["hybrid_no_snapshots"], res["dense"]
    assert summary["outputs_equal"]
    assert off["hit_rate"] == 0 and off["prefill_tokens_computed"] == off["prompt_tokens"]
    assert off["state_snapshots"] == 0 and on["state_snapshots"] > 0 and dense["state_snapshots"] is None
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"] and on["hit_rate"] > 0.4
    assert dense["hit_rate"] > 0
    for r in res.values():
        assert r["pools_free_after"] and r["ttft_ms_mean"] > 0 and r["total_tok_s"] > 0
    assert set(report) == set(json.loads(COMMITTED.read_text()))  # the committed full run's layout
