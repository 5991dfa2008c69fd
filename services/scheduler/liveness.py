"""The scheduler pod's liveness: the gRPC health service ``liveness`` fails while the engine is stuck.

The engine thread notes the time at the end of every iteration (EngineWorker.beat). A stuck step (a
hung kernel or device, a collective waiting on a silent peer) ends no iteration, and requests then
wait on it for good while the pod looks healthy: its gRPC server, load reports and heartbeats run on
other threads. ``LivenessWatch`` checks the engine a few times per ``timeout_s``; once the engine has
had work and finished no iteration for longer than that, the ``liveness`` service reports
NOT_SERVING (the kubelet's liveness probe asks it, and restarts the pod after its failure
threshold); when the engine steps again it reports SERVING again. An idle engine never fails it.

Readiness is the "" service, as before: draining (SIGTERM) fails it and leaves liveness alone, so a
draining pod is not restarted mid-drain; a stall leaves readiness alone, so the two probes fail for
their own reasons. The watch starts with the gRPC server, after the engine's warm-up: the time that
takes (compilation, graph capture) never counts.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from radixserve.scheduler.worker import EngineWorker

log = logging.getLogger(__name__)

LIVENESS_SERVICE = "liveness"  # the gRPC health service name the liveness probe asks for
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class LivenessWatch:
    """Sets ``health``'s ``liveness`` service from ``worker``'s progress; ``timeout_s`` 0: always
    SERVING (no thread)."""

    def __init__(self, worker: EngineWorker, health: HealthServicer, timeout_s: float) -> None:
        if not timeout_s >= 0:  # NaN too
            raise ValueError(f"stall_timeout={timeout_s}: expected 0 (off) or a number of seconds")
        self.worker = worker
        self.health = health
        self.timeout_s = timeout_s
        # A stall is seen at most one period late: a fifth of the timeout, within [50 ms, 1 s].
        self.period_s = min(1.0, max(0.05, timeout_s / 5))
        self.live = True
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        health.set(LIVENESS_SERVICE, _SERVING)

    def start(self) -> None:
        if self.timeout_s > 0:
            self._thread.start()

    def check(self) -> bool:
        """One look at the engine: updates the health service on a change; returns whether it is live."""
        stalled_s = self.worker.seconds_since_step()
        live = stalled_s <= self.timeout_s
        if live != self.live:
            self.live = live
            self.health.set(LIVENESS_SERVICE, _SERVING if live else _NOT_SERVING)
            if live:
                log.warning("the engine thread steps again: liveness SERVING")
            else:
                log.error(
                    "the engine thread has had work and finished no step for %.1f s (--stall-timeout"
                    " %g s): liveness NOT_SERVING, the kubelet will restart this pod; it is at:\n%s",
                    stalled_s,
                    self.timeout_s,
                    self._engine_stack(),
                )
        return live

    def _run(self) -> None:
        while not self.worker.stopped.wait(self.period_s):
            self.check()

    def _engine_stack(self) -> str:
        """Where the engine thread is stuck (what an operator needs to report the hang)."""
        frame = sys._current_frames().get(self.worker.thread_id or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(the engine thread ended)"
