"""The local start benchmark runs (one restart per setting): both settings report every figure, and
each starts its services the way it names (forked by the zygote, or each its own interpreter). No
timing is asserted (the figures live in its JSON)."""

import json

from radixserve.bench_index import load_benchmark


def test_a_short_run_reports_both_settings_each_starting_services_its_own_way(tmp_path):
    bench = load_benchmark("local_start")
    assert bench.main(["--restarts", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "local_start.json").read_text())
    assert (tmp_path / "local_start.png").stat().st_size > 0
    res = report["results"]
    assert list(res) == ["zygote", "exec"]
    assert res["zygote"]["services_forked"] == res["zygote"]["services"] == 3
    assert res["exec"]["services_forked"] == 0 and res["exec"]["services"] == 3
    for r in res.values():
        assert len(r["scheduler_restarts_s"]) == 1 and r["scheduler_restarts_s"][0] > 0
        for start in (r["first_start"], r["second_start"]):
            assert set(start) == {"detokenizer", "scheduler-0", "gateway", "cluster"}
            assert start["cluster"] >= max(start["detokenizer"], start["scheduler-0"], start["gateway"]) > 0
