"""The spread benchmark runs (quick mode): every request completes in every configuration, and with
two pods the default router uses both. No timing is asserted (the figures live in its JSON)."""

import json

from radixserve.bench_index import load_benchmark


def load():
    return load_benchmark("spread")


def test_workload_prompts_share_no_first_block():
    reqs = load().build_workload(40, (20, 30), (4, 8), 500, seed=3)
    assert len({r["input_ids"][0] for r in reqs}) == 40
    assert all(20 <= len(r["input_ids"]) <= 30 and min(r["input_ids"]) >= 5 for r in reqs)


def test_quick_run_completes_every_request_and_two_pods_share_the_work(tmp_path):
    # One router, the default (each configuration starts a cluster, the bulk of the run's time)
    spread = load()
    argv = ["--quick", "--num-requests", "16", "--routers", "cache-aware", "--out", str(tmp_path)]
    assert spread.main(argv) == 0
    report = json.loads((tmp_path / "spread.json").read_text())
    assert (tmp_path / "spread.png").stat().st_size > 0
    for name, r in report["results"].items():
        assert r["ok"] == 16 and r["failed"] == 0, (name, r)
        assert sum(r["requests_per_pod"]) == 16
    assert min(report["results"]["2 pods, cache-aware"]["requests_per_pod"]) >= 4
    assert list(report["results"]) == ["1 pod, cache-aware", "2 pods, cache-aware"]
    assert set(report["two_pods_over_one"]) == {"cache-aware"}
    assert report["config"]["routers"] == ["cache-aware"]
