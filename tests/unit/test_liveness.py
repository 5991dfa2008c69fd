"""A hung engine fails the scheduler's liveness check; an idle one never does; draining fails readiness.

A real scheduler pod in-process (tiny demo model, the gRPC server from ``serve``, a real detokenizer
to stream to), asked over gRPC as the kubelet asks: grpc.health.v1 Check, service "liveness" for the
liveness probe and "" for readiness. The hang is a test hook: the engine loop's step blocks on an
Event, as a step does whose kernel or collective never returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve import Engine, SamplingParams
from radixserve.common.ports import free_port
from radixserve.common.rpc import pb, pb_grpc
from radixserve.common.wire import sampling_to_proto
from radixserve.detokenizer.server import serve as serve_detokenizer
from radixserve.scheduler.__main__ import main as scheduler_main
from radixserve.scheduler.server import SchedulerService, serve, shutdown

STALL_S = 0.4  # --stall-timeout of these pods
MODEL = "tiny"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def model_dir(demo_model):
    return demo_model("llama")


@pytest.fixture(scope="module")
def detokenizer(model_dir) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    server, _ = serve_detokenizer(str(model_dir), address, workers=4)
    yield address
    server.stop(0)


class HangingStep:
    """The engine loop's step, which blocks before stepping while ``hold`` is set, until ``go``;
    each step then takes ``pace_s`` longer (a slow engine, well within the stall timeout)."""

    def __init__(self, step: Callable[[], list]) -> None:
        self.step = step
        self.hold = threading.Event()
        self.go = threading.Event()
        self.pace_s = 0.0
        self.hung_at: float | None = None  # when a step began to block (time.monotonic())

    def __call__(self) -> list:
        if self.hold.is_set() and not self.go.is_set():
            self.hung_at = time.monotonic()
            self.go.wait(60)
        time.sleep(self.pace_s)
        return self.step()


@dataclass
class Pod:
    server: grpc.Server
    service: SchedulerService
    health: object
    step: HangingStep
    channel: grpc.Channel

    def status(self, service: str) -> int:
        reply = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(reply.status)

    def submit(self, rid: str, max_new_tokens: int = 4) -> None:
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        pb_grpc.SchedulerStub(self.channel).Submit(
            pb.TokenizedRequest(
                rid=rid, input_ids=[5, 17, 23, 42], sampling=sampling_to_proto(sp), reply_to="127.0.0.1:9"
            ),
            timeout=10,
        )

    def stall_gauge(self) -> float | None:
        reg = self.service.metrics.registry
        return reg.get_sample_value("radixserve_engine_stall_seconds", {"model_name": MODEL})

    def ended(self, reason: str) -> float:
        reg = self.service.metrics.registry
        labels = {"model_name": MODEL, "finish_reason": reason}
        return reg.get_sample_value("radixserve_scheduler_requests_total", labels) or 0.0


def start_pod(model_dir, detokenizer: str, stall_timeout_s: float) -> Pod:
    engine = Engine(model_dir, max_total_tokens=2048, max_running_requests=8)
    step = HangingStep(engine.loop.step)
    engine.loop.step = step  # type: ignore[method-assign]  # the test hook: the worker calls loop.step()
    address = f"127.0.0.1:{free_port()}"
    server, service, health = serve(
        engine, address, detokenizer, model_name=MODEL, stall_timeout_s=stall_timeout_s
    )
    return Pod(server, service, health, step, grpc.insecure_channel(address))


@pytest.fixture
def pod(model_dir, detokenizer) -> Iterator[Pod]:
    p = start_pod(model_dir, detokenizer, STALL_S)
    yield p
    p.step.go.set()
    p.channel.close()
    if not p.service.worker.stopped.is_set():
        shutdown(p.server, p.service, p.health, 2)  # type: ignore[arg-type]


def until(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``cond`` until true; returns when it became so (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic()


def stays(pod: Pod, service: str, status: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert pod.status(service) == status, f"{service!r} left {status} within {seconds} s"
        time.sleep(0.05)


def test_an_idle_engine_never_fails_liveness(pod):
    assert pod.status("liveness") == SERVING and pod.status("") == SERVING
    stays(pod, "liveness", SERVING, 4 * STALL_S)  # nothing to do: however long it waits
    assert pod.stall_gauge() == 0.0
    pod.submit("r0")  # some work, done, then idle again
    until(lambda: pod.ended("length") == 1, 30, "the request ended")
    stays(pod, "liveness", SERVING, 4 * STALL_S)


def test_a_hung_step_fails_liveness_after_the_stall_timeout_and_recovers_when_it_steps(pod):
    pod.step.hold.set()
    pod.submit("r1", max_new_tokens=8)
    until(lambda: pod.step.hung_at is not None, 10, "the step hung")
    failed_at = until(lambda: pod.status("liveness") == NOT_SERVING, STALL_S + 5, "liveness failed")
    assert pod.step.hung_at is not None
    # Not before the timeout (counted from the last iteration's end, a moment before the step hung:
    # the request's admission), and soon after it (the watch looks every STALL_S / 5).
    assert STALL_S / 4 < failed_at - pod.step.hung_at < STALL_S + 2
    assert pod.status("") == SERVING  # readiness is not liveness: a stall leaves it alone
    gauge = pod.stall_gauge()
    assert gauge is not None and gauge > STALL_S
    pod.step.go.set()  # the step returns: the engine steps again
    until(lambda: pod.status("liveness") == SERVING, 5, "liveness recovered")
    until(lambda: pod.ended("length") == 1, 30, "the request ended")
    assert pod.stall_gauge() == 0.0


def test_draining_fails_readiness_whatever_liveness_says(pod):
    pod.step.hold.set()
    pod.submit("r2", max_new_tokens=16)
    until(lambda: pod.step.hung_at is not None, 10, "the step hung")
    stopper = threading.Thread(target=shutdown, args=(pod.server, pod.service, pod.health, 30))
    stopper.start()  # SIGTERM's path: not ready, drain (waits for r2), stop
    until(lambda: pod.status("") == NOT_SERVING, 5, "readiness failed at the drain")
    until(lambda: pod.status("liveness") == NOT_SERVING, STALL_S + 5, "liveness failed (hung)")
    pod.step.pace_s = STALL_S / 4  # r2's 16 steps then take 1.6 s: the drain is still on below
    pod.step.go.set()
    until(lambda: pod.status("liveness") == SERVING, 1, "liveness recovered")
    assert pod.status("") == NOT_SERVING  # the recovery did not make a draining pod ready again
    stopper.join(30)
    assert not stopper.is_alive() and pod.ended("length") == 1  # r2 finished within the drain


def test_stall_timeout_zero_turns_the_check_off(model_dir, detokenizer):
    p = start_pod(model_dir, detokenizer, 0)
    try:
        p.step.hold.set()
        p.submit("r3")
        until(lambda: p.step.hung_at is not None, 10, "the step hung")
        stays(p, "liveness", SERVING, 4 * STALL_S)
        assert (p.stall_gauge() or 0) > 3 * STALL_S  # the metric still tells
    finally:
        p.step.go.set()
        p.channel.close()
        shutdown(p.server, p.service, p.health, 2)  # type: ignore[arg-type]


def test_a_negative_stall_timeout_is_refused_naming_the_flag(caplog):
    args = ["--model", "unused", "--detokenizer", "127.0.0.1:9", "--stall-timeout", "-1"]
    assert scheduler_main(args) == 1
    assert "--stall-timeout" in caplog.text and "-1" in caplog.text
