"""How a service's process ends once it has shut itself down."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` after the service has stopped on its own terms (drained, closed, telemetry
    flushed): flush the logs and stdio, then skip the interpreter's teardown. That teardown (gRPC's
    and torch's native finalisers) took about a second per process and did nothing a stopped
    service needs; a pod's termination and every restart waited on it."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe: nothing more to say
            stream.flush()
    os._exit(code)


def exit_if_still_running_after(seconds: float, what: str) -> threading.Timer:
    """Once a service has begun to stop: end the process with status 1 if it has not ended within
    ``seconds`` (or the timer returned is cancelled first). A stop that waits on a library with no
    timeout of its own (gRPC's shutdown of a server or channel whose peers died with it) must not
    leave a process behind."""

    def expire() -> None:
        logging.getLogger(__name__).error("%s still stopping after %.0f s; exiting", what, seconds)
        exit_now(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer
