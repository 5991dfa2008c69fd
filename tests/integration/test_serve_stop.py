"""``radixserve serve`` stops every process it ever started (issue 44): after services were killed and
restarted, one SIGTERM to it leaves no process of the server behind, the restarted ones included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from radixserve.launcher import free_port
from tests.helpers.procs import Proc, descendants, running, service_names


def _wait_for(what: str, check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.1)


def test_a_stop_after_restarts_leaves_no_process_of_the_server(model_dir) -> None:
    argv = [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(model_dir)]
    argv += ["--port", str(free_port()), "--torch-threads", "1", "--detokenizers", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    seen: set[Proc] = set()
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("radixserve: serving ")
        first = descendants(proc.pid)
        seen |= first
        services = {p: service_names(p) for p in first}  # the zygote's children, if it forked them
        detokenizers = [p for p, c in services.items() if "detokenizer" in c]
        schedulers = [p for p, c in services.items() if "scheduler" in c]
        assert len(detokenizers) == 2 and len(schedulers) == 1, services
        # a detokenizer and the scheduler killed outright: the supervisor starts them again
        for victim in (detokenizers[0], schedulers[0]):
            os.kill(victim[0], signal.SIGKILL)
        _wait_for("the killed services restarted", lambda: len(descendants(proc.pid) - first) >= 2)
        time.sleep(1.0)  # the new ones under way (loading), not yet serving: a stop must end them too
        seen |= descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        print(f"stopped in {time.monotonic() - t0:.1f} s")
        _wait_for("every process of the server gone", lambda: not [p for p in seen if running(p)], 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
