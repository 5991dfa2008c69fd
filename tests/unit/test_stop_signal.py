"""Signal handlers take no lock (issue 44): a handler runs in the main thread between two bytecodes of
whatever it interrupted, so one that waits for a lock that code holds waits forever. Each service's
entry point installs its handler first thing; the test takes the handler it installed and runs it
while every lock of the stop primitive behind it is held."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator

import pytest

from radixserve.common.stop_signal import StopSignal

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def _locks(obj: object, depth: int = 3) -> list[object]:
    """The locks an object holds in its attributes (a Condition's, an Event's condition's...)."""
    if isinstance(obj, _LOCK_TYPES):
        return [obj]
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    return [lock for v in vars(obj).values() for lock in _locks(v, depth - 1)]


def returns_while_locked(handler: Callable[[int, object], None], primitive: object) -> bool:
    """Whether ``handler`` returns within 2 s while another thread holds every lock of ``primitive``."""
    locks = _locks(primitive)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        for lock in locks:
            lock.acquire()  # type: ignore[attr-defined]
        held.set()
        release.wait()
        for lock in reversed(locks):
            lock.release()  # type: ignore[attr-defined]

    threading.Thread(target=holder, daemon=True).start()
    held.wait()
    done = threading.Event()
    runner = threading.Thread(target=lambda: (handler(signal.SIGTERM, None), done.set()), daemon=True)
    runner.start()
    returned = done.wait(2.0)
    release.set()
    runner.join(5)
    return returned


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_the_old_handler_an_event_set_hangs_while_its_lock_is_held() -> None:
    """The check can fail: ``threading.Event.set`` in a handler waits for the Event's lock."""
    stop = threading.Event()
    assert not returns_while_locked(lambda *_: stop.set(), stop)


def _detokenizer() -> int:
    from radixserve.detokenizer.__main__ import main

    return main(["--model", "/nonexistent/model"])


def _scheduler() -> int:
    from radixserve.scheduler.__main__ import main

    return main(["--model", "/nonexistent/model", "--detokenizer", "127.0.0.1:1"])


def _serve() -> int:
    from radixserve.cli import main

    return main(["serve", "--model", "/nonexistent/model"])


ENTRIES = [_detokenizer, _scheduler, _serve]


@pytest.mark.parametrize("entry", ENTRIES, ids=["detokenizer", "scheduler", "serve"])
def test_each_services_stop_handler_returns_while_its_stop_primitives_locks_are_held(
    entry: Callable[[], int], restore_handlers: None
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert entry() != 0  # a bad --model: it stops before serving, its handler installed
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        stop = getattr(handler, "__self__", None)
        assert isinstance(stop, StopSignal), handler
        stop.ready()  # as once it serves (before that the signal's default action ends the process)
        assert returns_while_locked(handler, stop)  # type: ignore[arg-type]
        assert stop.is_set() and stop.wait(0)


def test_a_burst_of_signals_at_a_waiting_loop_wakes_it_and_never_blocks(restore_handlers: None) -> None:
    stop = StopSignal().install()
    assert not stop.wait(0.01)
    for _ in range(10_000):  # far more than the pipe holds: a full pipe drops the byte, not the stop
        os.kill(os.getpid(), signal.SIGTERM)
    assert stop.wait(5) and stop.signum == signal.SIGTERM


def test_a_signal_before_ready_ends_the_process_at_once() -> None:
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from radixserve.common.stop_signal import StopSignal\n"
        "StopSignal(exit_until_ready=True).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=20).returncode == -signal.SIGTERM


def test_a_stop_from_another_thread_wakes_the_main_loop() -> None:
    stop = StopSignal()
    threading.Timer(0.1, stop.set).start()
    assert stop.wait(10) and stop.signum is None
