"""The cold start benchmark runs (quick mode, no held request): every start-up phase of a scheduler
process is reported, and the loader's and cat's read rates are measured on the same
files, warm and cold. No timing is asserted (the figures live in its JSON)."""

import json

from radixserve.bench_index import load_benchmark
from radixserve.scheduler.startup import PHASES


def test_quick_run_reports_every_phase_and_both_read_rates(tmp_path):
    bench = load_benchmark("cold_start")
    assert bench.main(["--quick", "--no-held", "--no-demo", "--gen-gb", "0.02", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cold_start.json").read_text())
    assert (tmp_path / "cold_start.png").stat().st_size > 0
    assert set(report["models"]) == {"generated-0.02GB"}
    for name, m in report["models"].items():
        assert set(m["phases"]) == set(PHASES), name
        assert m["phases"]["weight_load"] > 0 and m["phases"]["process_start"] > 0
        for cache in ("warm", "cold"):
            rates = m["read"][cache]
            assert rates["cat_gb_per_s"] > 0 and rates["loader_gb_per_s"] > 0, (name, cache)
    assert report["models"]["generated-0.02GB"]["read"]["bytes"] > 15e6
