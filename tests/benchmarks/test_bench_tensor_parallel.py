"""The tensor-parallel benchmark runs (smoke mode, through the CLI): every configuration produces
tokens, tp=2's greedy tokens equal tp=1's, and the report has what it claims. No timing is asserted
(the figures live in benchmarks/results/tensor_parallel.json)."""

import json

import pytest

from radixserve.bench_index import load_benchmark
from radixserve.cli import main


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tensor_parallel")
    argv = ["bench", "tensor_parallel", "--smoke", "--device", "cpu", "--cores", "2", "--out", str(out)]
    assert main(argv) == 0
    assert (out / "tensor_parallel.png").stat().st_size > 0
    return json.loads((out / "tensor_parallel.json").read_text())


def test_configurations_split_the_cores_and_add_tp1_at_the_same_threads():
    tp = load_benchmark("tensor_parallel")
    keys = [c["key"] for c in tp.configurations([1, 2], 8, cpu=True)]
    assert keys == ["tp1_threads8", "tp2_threads4", "tp1_threads4"]
    assert [c["key"] for c in tp.configurations([1, 2], 1, cpu=True)] == ["tp1_threads1", "tp2_threads1"]
    assert [c["key"] for c in tp.configurations([1, 2], 8, cpu=False)] == ["tp1_threads8", "tp2_threads4"]


def test_smoke_run_reports_every_configuration_and_tp2_matches_tp1(smoke_run):
    report = smoke_run
    assert {"benchmark", "machine", "config", "results", "speedup", "same_tokens", "note"} <= set(report)
    assert report["same_tokens"] is True
    assert report["note"]
    cfg = report["config"]
    assert cfg["smoke"] and cfg["device"] == "cpu" and cfg["torch"] and cfg["model_shape"]["hidden_size"]
    assert set(cfg["threads_per_rank"]) == set(report["results"])
    assert set(report["results"]) == {"tp1_threads2", "tp2_threads1", "tp1_threads1"}
    for key, r in report["results"].items():
        assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"], key
        assert all(x > 0 for x in r["repeats_output_tok_s"]) and r["wall_s"] > 0, key
        assert r["outputs_exact"] and r["same_tokens_as_tp1"], key
        assert len(r["weight_bytes_per_rank"]) == r["tp_size"] and r["kv_tokens"] > 0, key
        assert r["threads_per_rank"] == cfg["threads_per_rank"][key]
    one, two = report["results"]["tp1_threads1"], report["results"]["tp2_threads1"]
    assert two["weight_bytes_per_rank"][0] < one["weight_bytes_per_rank"][0]  # the model is split
    assert set(report["speedup"]) == {"tp2_threads1_vs_tp1_all_cores", "tp2_threads1_vs_tp1_same_threads"}
