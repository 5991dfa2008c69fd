"""How a service's process ends: a stop that hangs is cut short (process_exit.py)."""

from __future__ import annotations

import subprocess
import sys

HANGS = """
import logging, time
from radixserve.common.process_exit import exit_if_still_running_after
logging.basicConfig(format="%(levelname)s %(message)s")
exit_if_still_running_after(1.0, "the gateway")
time.sleep(120)  # a shutdown that never returns
"""

ENDS = """
from radixserve.common.process_exit import exit_if_still_running_after, exit_now
exit_if_still_running_after(60.0, "the gateway")
exit_now(0)  # a stop that ends on its own: the timer keeps nothing alive
"""


def test_a_stop_that_hangs_ends_the_process_with_status_1_and_says_so() -> None:
    r = subprocess.run([sys.executable, "-c", HANGS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "ERROR the gateway still stopping after 1 s; exiting" in r.stderr


def test_a_stop_that_ends_is_not_held_by_the_timer() -> None:
    r = subprocess.run([sys.executable, "-c", ENDS], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stderr == ""
