"""The MoE benchmark runs (a few tiny requests, through the CLI) and reports what it claims: bench
offline's report on the MoE demo model, and the MoE layer's launches on the CUDA path.

No timing is asserted: the figures live in benchmarks/results/moe.json.
"""

import json
from pathlib import Path

from radixserve.cli import main

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "moe.json"
TINY = ["--quick", "--num-requests", "4", "--input-range", "8", "16", "--output-range", "2", "6"]
TINY += ["--prefix-len", "8", "--check-requests", "1", "--hf-batch-sizes", "2"]


def test_a_tiny_run_reports_throughput_correctness_and_launches(tmp_path):
    assert main(["bench", "moe", *TINY, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "moe.png").stat().st_size > 0
    report = json.loads((tmp_path / "moe.json").read_text())
    facts = report["config"]["model_facts"]
    assert facts["arch"] == "qwen3_moe" and facts["our_moe_experts"] == "torch"
    assert facts["moe"]["num_experts"] == 4 and facts["moe"]["sparse_layers"] == [1]
    assert report["config"]["model"] == "demo qwen3_moe/tiny (built in a temp dir)"
    for name in ("hf", "ours_normal", "ours_overlap"):
        assert report["results"][name]["output_tok_s"] > 0, name
    assert report["correctness_vs_hf_batch1"]["all_equal"]
    counts = report["launches"]
    assert counts["moe_block"] == sum(counts["moe_block_ops"].values())
    assert counts["moe_block_ops"]["aten._grouped_mm"] == 2
    assert counts["dense_decoder_layer"] < counts["moe_decoder_layer"]
    assert set(report) == set(json.loads(COMMITTED.read_text()))  # the committed full run's layout
