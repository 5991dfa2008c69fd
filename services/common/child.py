"""``python -m radixserve.common.child MODULE [ARGS...]``: run ``python -m MODULE ARGS...`` as a child
that dies with the process that started it (``radixserve serve``'s launcher).

The death signal is set here, in the child's own first lines, not in a ``preexec_fn``: a
``preexec_fn`` runs Python between fork and exec, which can abort the child when the parent has
gRPC threads (gRPC's fork handlers), and it forces fork where the launcher could spawn.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import warnings

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


def prctl(option: int, arg: int | bytes) -> bool:
    """Linux's prctl(2) through libc; False where there is none."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
    except (OSError, AttributeError):
        return False
    return True


def die_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """``sig`` to this process when its parent (the thread that started it) ends; Linux only."""
    if not prctl(PR_SET_PDEATHSIG, sig):
        return
    if os.getppid() != parent_pid:  # it ended before the line above: nobody would signal us
        os.kill(os.getpid(), sig)


def run(argv: list[str]) -> None:
    """Run ``python -m argv[0] argv[1:]`` in this process, dying with the parent the launcher
    named (``RADIXSERVE_PARENT_PID``: itself, or its zygote, radixserve.common.zygote)."""
    parent = os.environ.pop("RADIXSERVE_PARENT_PID", None)
    if parent is not None:
        die_with_parent(int(parent))
    sys.argv = list(argv)
    with warnings.catch_warnings():  # forked by the zygote, the module may be imported already
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def main() -> None:
    run(sys.argv[1:])


if __name__ == "__main__":
    main()
