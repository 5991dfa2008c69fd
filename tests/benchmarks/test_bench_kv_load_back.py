"""benchmarks/kv_load_back.py runs (--quick) and reports what the load-back metric measures.

No timing is asserted: the figures live in benchmarks/results/kv_load_back.json.
"""

import json

import torch

from radixserve.bench_index import load_benchmark


def test_kv_load_back_reports_each_size_with_the_metrics_time_and_bytes(tmp_path):
    threads = torch.get_num_threads()
    try:
        assert (
            load_benchmark("kv_load_back").main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
        )
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "kv_load_back.json").read_text())
    per_token = 2 * 2 * 2 * 64 * 2  # K and V, 2 layers, 2 KV heads, head_dim 64, bf16
    assert [r["tokens"] for r in data["results"]] == [16, 64]
    for r in data["results"]:
        assert r["bytes"] == r["tokens"] * per_token
        assert 0 < r["metric_best_ms"] <= r["metric_median_ms"] and r["gib_per_s"] > 0
        # what the metric reports lies within the wall time around each load (the medians of pairs
        # ordered so): the metric times the copies, not more
        assert r["metric_median_ms"] <= r["wall_median_ms"]
