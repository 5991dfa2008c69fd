"""The offline throughput benchmark runs (quick mode, through the CLI) and reports what it claims.

No timing is asserted: speed goals live in the benchmark's own output (benchmarks/results/offline.json).
"""

import json
from pathlib import Path

import pytest

from radixserve.bench_index import load_benchmark
from radixserve.cli import main

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "offline.json"


@pytest.fixture(scope="module")
def offline():
    return load_benchmark("offline")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, dict]:
    """One ``radixserve bench offline --quick`` for every test that reads its output."""
    out = tmp_path_factory.mktemp("offline")
    assert main(["bench", "offline", "--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "offline.json").read_text())


def key_structure(doc: dict) -> dict:
    """Top-level keys, and one level down the keys of each dict-valued entry."""
    return {k: sorted(v) if isinstance(v, dict) else None for k, v in doc.items()}


def test_workload_is_seeded_avoids_special_ids_and_shares_the_prefix(offline):
    a = offline.build_workload(40, (64, 128), (8, 16), 0.5, 32, 2048, seed=3)
    b = offline.build_workload(40, (64, 128), (8, 16), 0.5, 32, 2048, seed=3)
    assert a == b
    assert all(min(r["input_ids"]) >= offline.SPECIAL_IDS for r in a)
    assert all(8 <= r["output_len"] <= 16 and 64 <= len(r["input_ids"]) <= 128 for r in a)
    shared = [r["input_ids"][:32] for r in a if r["shared"]]
    assert 0 < len(shared) < 40 and all(s == shared[0] for s in shared)


def test_repeats_are_judged_on_their_median_paired_ratios(offline):
    mod = offline

    def rep(hf: float, normal: float, overlap: float) -> dict:
        return {
            n: {"output_tok_s": v, "speedup_vs_hf": v / hf}
            for n, v in (("hf", hf), ("ours_normal", normal), ("ours_overlap", overlap))
        }

    reps = [rep(100, 310, 300), rep(90, 280, 290), rep(110, 320, 325)]
    v = mod.verdict(reps)
    assert v["speedup_normal_vs_hf"] == pytest.approx(3.1)  # median of 3.1, 3.11, 2.91
    assert v["ours_ge_3x_hf"] and not v["ours_ge_3x_hf_in_every_repeat"]
    assert v["overlap_not_slower_than_normal"] and not v["overlap_not_slower_in_every_repeat"]
    med = mod.median_runs(reps)
    assert med["hf"]["output_tok_s"] == 100 and med["hf"]["repeats_output_tok_s"] == [100, 90, 110]
    assert med["ours_overlap"]["output_tok_s"] == 300
    assert med["ours_overlap"]["speedup_vs_hf"] == pytest.approx(3.0)


def test_bench_offline_parses_its_flags(offline):
    args = offline.parse_args(["--quick", "--input-range", "8", "16", "--hf-batch-sizes", "2", "4"])
    assert args.quick and list(args.input_range) == [8, 16] and list(args.hf_batch_sizes) == [2, 4]


def test_quick_run_reports_three_systems_with_exact_token_counts(quick_run):
    out, data = quick_run
    assert (out / "offline.png").stat().st_size > 0
    results = data["results"]
    assert set(results) == {"hf", "ours_normal", "ours_overlap"}
    wl = data["config"]["workload"]
    for name in ("ours_normal", "ours_overlap"):
        r = results[name]
        assert r["outputs_exact"]
        assert r["output_tokens"] == wl["output_tokens"]
        assert len(r["completion_tokens"]) == wl["num_requests"]
        assert r["steps"] > 0 and r["host_s"] >= 0
    assert len(data["repeats"]) == 1 and data["verdict"]["repeats"] == 1  # quick: one of each
    assert data["repeats"][0]["hf"]["output_tok_s"] == results["hf"]["output_tok_s"]
    assert data["verdict"]["overlap_vs_normal_each"] == [
        results["ours_overlap"]["output_tok_s"] / results["ours_normal"]["output_tok_s"]
    ]
    assert results["hf"]["output_tokens"] == wl["output_tokens"]
    assert results["hf"]["raw_generated_tokens"] >= wl["output_tokens"]
    assert {"cpu_count", "torch_threads", "python", "torch", "date"} <= set(data["machine"])
    # the host-bound check (tiny model): one pair in quick mode, each loop exact
    hb = data["host_bound"]
    (pair,) = hb["pairs"]
    assert set(pair) == {"normal", "overlap", "overlap_thread"}
    assert all(r["outputs_exact"] for r in pair.values())
    assert pair["normal"]["forwards_on_worker_thread"] == pair["normal"]["forwards_inline"] == 0
    forced = pair["overlap_thread"]
    assert forced["forwards_inline"] == 0 and forced["forwards_on_worker_thread"] > 0
    assert hb["overlap_thread_vs_normal_each"] == [forced["output_tok_s"] / pair["normal"]["output_tok_s"]]
    assert data["correctness_vs_hf_batch1"]["requests"]


def test_quick_run_has_the_committed_full_runs_key_structure(quick_run):
    """Same report layout as benchmarks/results/offline.json (written by the full run)."""
    committed = json.loads(COMMITTED.read_text())
    committed.pop("profile_normal_mode", None)  # only with --profile, which the quick run leaves off
    assert key_structure(quick_run[1]) == key_structure(committed)
