"""A stop request that signal handlers can make without taking a lock.

A Python signal handler runs in the main thread between two bytecodes of whatever it interrupted.
If it takes a lock (``threading.Event.set`` takes its condition's), and the code it interrupted
holds that lock or is inside the same primitive's wait (``Event.wait`` re-acquiring it), the handler
waits for a lock its own thread must release: the process hangs for good, deaf to further signals.

``StopSignal`` takes no lock on the signal path: the handler stores the signal number (one attribute
store) and writes one byte to a non-blocking pipe (``os.write``, a system call). ``wait`` sleeps in
``select`` on the pipe's other end, so the main loop wakes at once. Other threads (an engine that
failed) stop the process the same way.

``exit_until_ready``: until ``ready()`` (a service still loading: nothing to drain or flush yet) the
signal ends the process at once, as if no handler were installed, instead of after the load.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Iterable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    def __init__(self, exit_until_ready: bool = False) -> None:
        self._ready = not exit_until_ready
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self.signum: int | None = None  # the first signal that asked to stop, if one did
        self._set = False

    def install(self, signals: Iterable[signal.Signals] = STOP_SIGNALS) -> StopSignal:
        """Make these signals set the stop (main thread only, as ``signal.signal`` requires)."""
        for sig in signals:
            signal.signal(sig, self.handler)
        return self

    def ready(self) -> None:
        """From now on a signal asks the main loop to stop (it has something to stop in order)."""
        self._ready = True

    def handler(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: no lock, no allocation beyond a few objects, returns at once."""
        if not self._ready:  # the default action: the process ends by this signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is None:
            self.signum = signum
        self.set()

    def set(self) -> None:
        """Ask the main loop to stop (from any thread, or a signal handler)."""
        self._set = True
        # A full pipe already wakes the loop: a burst of signals loses nothing by a failed write.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"\0")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the stop is set or ``timeout`` passes; returns whether it is set."""
        if self._set:
            return True
        with contextlib.suppress(InterruptedError):  # a signal woke select: the flag says which
            select.select([self._read], [], [], timeout)
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self._read, 4096)
        return self._set
