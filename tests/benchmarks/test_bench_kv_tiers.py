"""The KV tiers benchmark runs (a few tiny conversations, through the CLI) and reports what it
claims: the same conversations with the tiers off, a host tier and host + disk, equal outputs,
fewer prompt tokens computed with the tiers, hits by tier, pools free after; with the hybrid demo
model, the tiers off and the host tier.

No timing is asserted: the figures live in benchmarks/results/kv_tiers.json.
"""

import json
from pathlib import Path

import pytest

from radixserve.cli import main

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kv_tiers.json"
TINY = ["--quick", "--conversations", "12", "--turns", "3", "--system-len", "64", "--new-tokens", "4"]
TINY += ["--concurrency", "2", "--host-fraction", "0.2"]  # a small host: some blocks go on to disk


def test_a_tiny_run_reports_prefill_tokens_hits_by_tier_and_ttft(tmp_path):
    assert main(["bench", "kv_tiers", *TINY, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "kv_tiers.png").stat().st_size > 0
    report = json.loads((tmp_path / "kv_tiers.json").read_text())
    res, summary = report["results"], report["summary"]
    off, host, disk = res["off"], res["host"], res["host_disk"]
    assert summary["outputs_equal"]
    assert off["hit_tokens"]["host"] == 0 and host["hit_tokens"]["host"] > 0
    assert disk["hit_tokens"]["disk"] > 0
    computed = off["prefill_tokens_computed"]
    assert host["prefill_tokens_computed"] < computed and disk["prefill_tokens_computed"] < computed
    for r in res.values():  # every prompt token is computed or served from a tier
        assert r["prefill_tokens_computed"] + sum(r["hit_tokens"].values()) == r["prompt_tokens"]
        assert r["pools_free_after"] and r["ttft_ms_p50"] > 0 and r["total_tok_s"] > 0
    assert set(report) == set(json.loads(COMMITTED.read_text()))  # the committed full run's layout


def test_a_tiny_hybrid_run_serves_host_hits_and_refuses_the_disk_tier(tmp_path, capsys):
    """``--arch qwen3_5``: the demo hybrid with the tiers off and the host tier (no disk tier)."""
    assert main(["bench", "kv_tiers", *TINY, "--arch", "qwen3_5", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kv_tiers.json").read_text())
    res = report["results"]
    assert set(res) == {"off", "host"} and report["summary"]["outputs_equal"]
    assert res["host"]["hit_tokens"]["host"] > 0 and res["host"]["pools_free_after"]
    assert res["host"]["prefill_tokens_computed"] < res["off"]["prefill_tokens_computed"]
    with pytest.raises(SystemExit) as refused:
        main(["bench", "kv_tiers", "--quick", "--arch", "qwen3_5", "--systems", "host_disk"])
    assert refused.value.code == 2
    assert "the disk tier does not serve hybrid models" in capsys.readouterr().err
