"""The logits-features benchmark runs (smoke mode, through the CLI) and reports every setting; no
timing is asserted (the figures live in benchmarks/results/logits_features.json)."""

import json

from radixserve.cli import main


def test_smoke_run_reports_every_setting_and_leaves_the_pool_full(tmp_path):
    assert main(["bench", "logits_features", "--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "logits_features.json").read_text())
    settings = {"free", "free+logprobs", "free+penalties", "mixed_json"}
    assert set(report["results"]) == set(report["relative_to_free"]) == settings
    for r in report["results"].values():
        assert r["output_tok_s_median"] > 0 and all(s > 0 for s in r["steps_each"])
    assert report["kv_pool_full_after"] is True
