"""How a service's process ends once it has shut itself down."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
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
