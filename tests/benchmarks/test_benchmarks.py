"""The benchmarks run (quick modes) and the policy simulation shows the behaviour it exists to show.

No timing is asserted here: speed goals live in the benchmarks' own output.
"""

import json
from pathlib import Path

import pytest

from radixserve.cli import BENCHMARKS, load_benchmark, main

load = load_benchmark


@pytest.fixture(scope="module")
def policy_sim():
    return load("policy_sim")


@pytest.fixture(scope="module")
def policy_sim_quick(policy_sim, tmp_path_factory) -> tuple[Path, dict]:
    """One ``--quick`` run for every test that reads its output."""
    out = tmp_path_factory.mktemp("policy_sim")
    assert policy_sim.main(["--quick", "--out", str(out), "--seed", "1"]) == 0
    return out, json.loads((out / "policy_sim.json").read_text())


def test_lpm_with_in_batch_dedup_prefills_the_shared_prompt_once(policy_sim):
    lpm = policy_sim.run("burst32", "lpm", seed=0, check_every=10)
    fcfs = policy_sim.run("burst32", "fcfs", seed=0)
    assert lpm["shared_prefix_hit_rate"] == pytest.approx(23 / 24)  # one compulsory miss
    assert fcfs["shared_prefix_hit_rate"] < lpm["shared_prefix_hit_rate"]


def test_fairness_never_lets_a_younger_request_overtake_an_overdue_one(policy_sim):
    r = policy_sim.run("poisson", "lpm", 1.0, p=0.75, seed=0, quick=True, check_every=10)
    assert r["overtaken_while_overdue"] == 0


def test_policy_sim_quick_writes_json_and_png(policy_sim_quick):
    out, data = policy_sim_quick
    assert "cost model" in json.dumps(data).lower()
    assert (out / "policy_sim.png").stat().st_size > 0


def test_policy_sim_quick_has_the_committed_full_runs_key_structure(policy_sim_quick):
    """Same layout as benchmarks/results/policy_sim.json (the full run): top-level keys, the keys of
    each dict-valued entry, and the kinds of result row (with and without a fairness timeout)."""
    committed = json.loads(
        (Path(__file__).resolve().parents[2] / "benchmarks/results/policy_sim.json").read_text()
    )
    quick = policy_sim_quick[1]

    def key_structure(doc: dict) -> dict:
        return {k: sorted(v) if isinstance(v, dict) else None for k, v in doc.items()}

    assert key_structure(quick) == key_structure(committed)
    assert {frozenset(r) for r in quick["results"]} == {frozenset(r) for r in committed["results"]}


def test_scheduler_overhead_runs_with_invariant_checks():
    mod = load("scheduler_overhead")
    rows = mod.run_benchmark(
        ns=(64,), page_sizes=(16,), decode_reps=5, prefill_reps=3, warmup=1, check_invariants=True
    )
    assert {r["kind"] for r in rows} >= {"decode", "prefill"}


def test_decode_attention_benchmark_compares_both_backends_on_the_same_output(tmp_path):
    import torch

    from radixserve.scheduler.model.attention import cpu as cpu_attention

    if cpu_attention.unavailable_reason(torch.device("cpu"), torch.float32) is not None:
        pytest.skip("no decode kernel here")
    threads = torch.get_num_threads()
    try:
        assert load("decode_attention").main(["--quick", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "decode_attention.json").read_text())
    assert set(data["results"]) == {"torch", "cpu"} and data["max_abs_diff"] < 1e-4
    assert all(r["best_ms"] > 0 for r in data["results"].values())


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_radixserve_bench_hands_every_argument_to_the_benchmark(name, monkeypatch):
    mod = load(name)
    seen: list[list[str]] = []
    monkeypatch.setattr(mod, "main", lambda argv: seen.append(list(argv)) or 0)
    assert main(["bench", name, "--help", "--out", "x", "--", "y"]) == 0
    assert seen == [["--help", "--out", "x", "--", "y"]]
