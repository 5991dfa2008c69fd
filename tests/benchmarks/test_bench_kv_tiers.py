"""The KV tiers benchmark runs (a few tiny conversations, through the CLI) and reports what it
claims: the same conversations with the tiers off and on, equal outputs, fewer prompt tokens
computed with a host tier, hits by tier, pools free after.

No timing is asserted: the figures live in benchmarks/results/kv_tiers.json.
"""

import json

from radixserve.cli import main

TINY = ["--quick", "--conversations", "6", "--turns", "3", "--system-len", "64", "--new-tokens", "4"]


def test_a_tiny_run_reports_prefill_tokens_hits_by_tier_and_ttft(tmp_path):
    assert main(["bench", "kv_tiers", *TINY, "--systems", "off", "host", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "kv_tiers.png").stat().st_size > 0
    report = json.loads((tmp_path / "kv_tiers.json").read_text())
    res, summary = report["results"], report["summary"]
    off, host = res["off"], res["host"]
    assert summary["outputs_equal"]
    assert off["hit_tokens"]["host"] == 0 and host["hit_tokens"]["host"] > 0
    assert host["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    for r in res.values():  # every prompt token is computed or served from a tier
        assert r["prefill_tokens_computed"] + sum(r["hit_tokens"].values()) == r["prompt_tokens"]
        assert r["pools_free_after"] and r["ttft_ms_p50"] > 0 and r["total_tok_s"] > 0
