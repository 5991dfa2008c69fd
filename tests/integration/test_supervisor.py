"""``radixserve serve``'s supervision: a service that exits is started again, with backoff after
fast crashes, and supervision gives up (with the reason) after several in a row. Real child
processes; the clock is passed in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixserve.launcher import RestartPolicy, Service, Supervisor


@dataclass
class Services:
    services: list[Service] = field(default_factory=list)


def crashing(name: str) -> Service:
    # a module that exits at once with code 1 (its one line: the required --model is missing)
    return Service(name, ["radixserve.detokenizer"])


def wait_exit(s: Service) -> None:
    assert s.proc is not None
    s.proc.wait(timeout=60)


def test_a_fast_crash_is_restarted_after_a_growing_backoff_then_supervision_gives_up() -> None:
    said: list[str] = []
    svc = crashing("scheduler-0")
    sup = Supervisor(
        Services([svc]),
        RestartPolicy(backoff_s=1.0, max_backoff_s=3.0, fast_crash_s=30.0, max_fast_crashes=4),
        said.append,
    )
    svc.start()
    delays = []
    for _ in range(3):
        wait_exit(svc)
        now = svc.started_at + 5.0  # it ran 5 s (< 30 s): a fast crash
        assert sup.poll(now) is None
        delays.append(svc.restart_at - now)
        pid = svc.proc.pid
        assert sup.poll(svc.restart_at - 0.01) is None and svc.proc.pid == pid  # not before its time
        assert sup.poll(svc.restart_at) is None and svc.proc.pid != pid  # started again
    assert delays == [1.0, 2.0, 3.0]  # doubling, capped
    assert svc.restarts == 3
    assert "scheduler-0 exited with code 1 after 5.0 s; restarting it in 1.0 s" in said[0]
    wait_exit(svc)
    why = sup.poll(svc.started_at + 5.0)  # the fourth fast crash in a row
    assert why is not None and "scheduler-0" in why and "4 times in a row" in why and "giving up" in why
    assert "(its last error: the following arguments are required: --model)" in why  # its own words


def test_a_crash_after_a_long_run_restarts_at_once_and_resets_the_count() -> None:
    svc = crashing("detokenizer")
    sup = Supervisor(
        Services([svc]), RestartPolicy(backoff_s=1.0, fast_crash_s=30.0, max_fast_crashes=2), lambda _: None
    )
    svc.start()
    wait_exit(svc)
    assert sup.poll(svc.started_at + 5.0) is None and svc.fast_crashes == 1  # fast
    assert sup.poll(svc.restart_at) is None
    wait_exit(svc)
    now = svc.started_at + 100.0  # this one ran 100 s
    assert sup.poll(now) is None and svc.fast_crashes == 0 and svc.restart_at == now
    assert sup.poll(now) is None and svc.restarts == 2


def test_the_supervisor_thread_restarts_a_killed_process_and_stops_restarting_when_stopped() -> None:
    svc = crashing("gateway")
    sup = Supervisor(
        Services([svc]),
        RestartPolicy(backoff_s=0.05, fast_crash_s=30.0, max_fast_crashes=1000),
        lambda _: None,
    )
    svc.start()
    sup.start()
    deadline = time.monotonic() + 60
    while svc.restarts < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sup.stop()
    n = svc.restarts
    time.sleep(0.5)
    assert svc.restarts == n  # stopped: no more restarts
    if svc.proc is not None and svc.proc.poll() is None:
        svc.proc.kill()


def test_the_default_policy_gives_up_on_the_fifth_fast_crash_after_1_2_4_8_s() -> None:
    svc = crashing("scheduler-1")
    sup = Supervisor(Services([svc]), RestartPolicy(), lambda _: None)
    svc.start()
    delays = []
    for _ in range(4):
        wait_exit(svc)
        now = svc.started_at + 1.0
        assert sup.poll(now) is None
        delays.append(svc.restart_at - now)
        assert sup.poll(svc.restart_at) is None
    assert delays == [1.0, 2.0, 4.0, 8.0]
    wait_exit(svc)
    why = sup.poll(svc.started_at + 1.0)
    assert why is not None and "5 times in a row" in why


def test_serve_tp_size_reaches_every_scheduler_and_splits_the_cores() -> None:
    import os
    from pathlib import Path

    from radixserve.cli import build_parser
    from radixserve.launcher import build_cluster

    assert build_parser().parse_args(["serve", "--tp-size", "2"]).tp_size == 2
    assert build_parser().parse_args(["serve"]).tp_size == 1
    cluster = build_cluster(Path("/models/m"), "m", schedulers=2, tp_size=2)
    threads = str(max(1, ((os.cpu_count() or 2) - 1) // 4))  # 2 schedulers x 2 ranks share the cores
    for s in cluster.schedulers:
        i = s.argv.index("--tp-size")
        assert s.argv[i + 1] == "2"
        assert s.argv[s.argv.index("--torch-threads") + 1] == threads
    one = build_cluster(Path("/models/m"), "m", schedulers=1)
    assert "--tp-size" not in one.schedulers[0].argv
