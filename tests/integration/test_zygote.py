"""The zygote (radixserve.common.zygote): a child it forks starts as ``subprocess.Popen`` would have
started it (argv, environment, working directory, its own session, its fds and no others, a fresh
random seed, an exit status and signals as Popen reports them), and none outlives the zygote. These
zygotes preload numpy.random only; `radixserve serve`'s preloads torch and transformers, and every cluster
the suite starts goes through it (tests/integration/test_failures.py kills its launcher outright)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.common import zygote
from radixserve.common.zygote import ForkedProcess, Zygote
from tests.helpers.procs import proc, running

PROBE = "tests.helpers.zygote_probe"


@pytest.fixture
def zyg() -> Iterator[Zygote]:
    z = Zygote(preload=("numpy.random",))  # its global generator seeded: children must reseed
    yield z
    z.close()


def _probe(z: Zygote, code: int, sleep_s: float = 0.0, **env: str) -> tuple[zygote.ChildProcess, int]:
    """Starts the probe; returns it and the read end of the pipe it reports on."""
    r, w = os.pipe()
    try:
        child = zygote.spawn(
            [PROBE, str(w), str(code), str(sleep_s)],
            {**os.environ, "PROBE": "yes", **env},
            pass_fds=(w,),
            stderr_pipe=True,
            zygote=z,
        )
    finally:
        os.close(w)
    return child, r


def _report(r: int) -> dict:
    with os.fdopen(r) as f:
        return json.loads(f.read())


def test_a_forked_child_starts_as_popen_would_start_it(zyg: Zygote, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # its working directory is ours at the time it is started
    child, r = _probe(zyg, code=7)
    assert isinstance(child, ForkedProcess)
    report = _report(r)
    assert child.wait(30) == 7 and child.returncode == 7 and child.poll() == 7
    assert child.stderr is not None and child.stderr.read() == b"probe: said its piece\n"
    passed = int(report["argv"][0])
    assert report["cwd"] == str(tmp_path)
    assert report["probe_env"] == "yes" and report["parent_pid_env"] is None  # run() took it
    assert report["session_leader"] is True  # its own session: Ctrl-C is the launcher's to handle
    assert report["comm"] == "zygote_probe"
    extra = set(report["fds"]) - {0, 1, 2, passed}
    assert len(extra) <= 1, report["fds"]  # at most the listing's own: none of the zygote's


def test_two_children_draw_different_random_numbers(zyg: Zygote) -> None:
    draws = []
    for _ in range(2):
        child, r = _probe(zyg, code=0)
        draws.append(_report(r)["random"])
        assert child.wait(30) == 0
    assert None not in draws and draws[0] != draws[1]


def test_signals_and_waits_are_reported_as_popen_reports_them(zyg: Zygote) -> None:
    child, r = _probe(zyg, code=0, sleep_s=60)
    _report(r)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    child.send_signal(signal.SIGTERM)  # after its exit: nothing happens (its pid may be reused)


def test_a_child_whose_import_time_environment_differs_is_started_with_popen(zyg: Zygote) -> None:
    child, r = _probe(zyg, code=3, OMP_NUM_THREADS="3")
    assert isinstance(child, subprocess.Popen)
    report = _report(r)
    assert child.wait(60) == 3 and report["probe_env"] == "yes" and report["random"] is None


def test_no_child_outlives_its_zygote(zyg: Zygote) -> None:
    child, r = _probe(zyg, code=0, sleep_s=60)
    _report(r)
    zyg.proc.send_signal(signal.SIGKILL)
    # ended by its own death signal (SIGTERM) within the grace, not killed after it
    assert child.wait(30) == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while (p := proc(child.pid)) is not None and running(p):
        assert time.monotonic() < deadline, "a forked child outlived its zygote"
        time.sleep(0.05)
    assert not zyg.alive
    again, r2 = _probe(zyg, code=5)  # the zygote is gone: started with Popen instead
    assert isinstance(again, subprocess.Popen) and again.wait(60) == 5
    os.close(r2)


def test_zygote_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_ZYGOTE", "0")
    assert zygote.shared() is None
