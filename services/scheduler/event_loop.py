"""The engine's event loops: normal and overlap ("zero-overhead").

normal:   schedule N -> run N -> process N -> schedule N+1 ...
overlap:  schedule N+1 and launch it while N runs; then process N. The host work of
          scheduling and processing hides behind the device's forward pass. Batch N+1 may
          feed tokens N has not sampled yet: they are FutureMap placeholders, resolved on
          the device in stream order (BatchScheduler._commit, ModelRunner.forward).

The "device stream" is a CUDA stream on CUDA and one ordered worker thread on CPU, so
the overlap loop runs, and is tested, everywhere. Results are read only after the
step's copy-done event (CUDA) or the worker's future (CPU).

A constrained request (structured outputs) cannot run ahead: the mask of its step N+1 is built on
the host from its grammar after that grammar accepted token N. So while the last batch launched holds
one, the loop first processes what is in flight, then schedules; those steps do not overlap.

On CPU the overlap loop overlaps only while recent forwards were long (see _DeviceStream):
both threads run Python under one GIL, so the host's work can hide only behind a forward's
long kernels, and a short, dispatch-bound forward would just pay the hand-off. While forwards
are short it steps exactly as the normal loop does: overlapping nothing, it should not pay the
overlap's lag either (batch N+1 is scheduled before N's finished requests free their room).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeAlias, TypedDict

import torch

from radixserve.scheduler.batch import ScheduleBatch
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.logits import StepScores
from radixserve.scheduler.model.runner import ModelRunner
from radixserve.scheduler.req import Req

# A step that found nothing to run while disk reads are in flight (every waiting request waits on
# one) sleeps until a read lands, this long at most: new requests still get in within it.
IDLE_READ_WAIT_S = 0.01

StepOutput: TypeAlias = tuple[list[int], "StepScores | None"]  # the step's tokens, its scores


@dataclass(frozen=True, slots=True)
class DeviceLaunch:
    """A forward launched on the CUDA side stream: its tokens (and scores) copying to the host
    until ``done`` fires."""

    tokens: torch.Tensor
    scores: StepScores | None
    done: torch.cuda.Event
    # Its device tensors were made on the main stream and must not go back to the caching
    # allocator (and be reused) while the side stream may still read them.
    batch: ForwardBatch


Launch: TypeAlias = "Future[StepOutput] | DeviceLaunch"


class TracedStep(TypedDict):
    mode: str
    batch_size: int
    gpu_ms: float
    idle_before_ms: float | None  # None for the first step traced


@dataclass
class LoopStats:
    steps: int = 0
    host_s: float = 0.0  # scheduling + preparing + processing (the engine's non-forward CPU time)
    wait_s: float = 0.0  # blocked on the device's results
    # the most recent steps' host times (bounded: a server runs for days)
    per_step_host_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))


class _DeviceStream:
    """Runs forwards in launch order; ``result`` blocks until a step's tokens are on the host.

    CUDA: a side stream; ``launch`` returns once the kernels are queued.

    CPU: one ordered worker thread. The main thread's Python (scheduling, processing) runs beside
    the worker only while the worker is inside a kernel that released the GIL; every hand-off costs
    a thread wake-up and the GIL changes hands at each op the worker dispatches, which short,
    dispatch-bound forwards cannot hide (measured: docs/benchmarks.md, the overlap loop on CPU). So
    on CPU ``overlaps`` is true only while recent forwards lasted at least ``cpu_thread_min_s`` (a
    moving average); otherwise the loop runs the forward itself (``ran_inline``), after whatever it
    launched before.
    """

    EMA = 0.2  # weight of the newest forward in the moving average

    def __init__(self, runner: ModelRunner, cpu_thread_min_s: float = 0.01) -> None:
        self.runner = runner
        self.cuda = runner.device.type == "cuda"
        self.cpu_thread_min_s = cpu_thread_min_s
        self.forward_s = 0.0  # CPU: moving average of the forwards' durations (the worker writes it too)
        self.threaded = self.inline = 0  # CPU forwards run each way
        self.inline_s = 0.0  # CPU: time spent in forwards run inline
        if self.cuda:
            self.stream = torch.cuda.Stream(runner.device)
        else:
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")

    @property
    def overlaps(self) -> bool:
        """Whether the next forward should run beside the host's work."""
        return self.cuda or self.forward_s >= self.cpu_thread_min_s

    def launch(self, fb: ForwardBatch, trace: GpuTrace | None = None) -> Launch:
        if not self.cuda:
            self.threaded += 1
            return self.worker.submit(self._forward_cpu, fb)
        dev = self.runner.device
        self.stream.wait_stream(torch.cuda.current_stream(dev))  # inputs copied on the main stream
        with torch.cuda.stream(self.stream):
            mark = trace.start(fb) if trace is not None else None
            result = self.runner.forward(fb)
            if mark is not None:
                mark.record(self.stream)
            host = result.tokens.to("cpu", non_blocking=True)
            scores = result.scores.to_host(non_blocking=True) if result.scores is not None else None
            done = torch.cuda.Event()
            done.record(self.stream)
        return DeviceLaunch(host, scores, done, fb)

    def _forward_cpu(self, fb: ForwardBatch) -> StepOutput:
        t = time.perf_counter()
        result = self.runner.forward(fb)
        tokens: list[int] = result.tokens.tolist()
        self._note(time.perf_counter() - t)
        return tokens, result.scores

    def ran_inline(self, seconds: float) -> None:
        """The loop ran a CPU forward itself, in ``seconds``."""
        self.inline += 1
        self.inline_s += seconds
        self._note(seconds)

    def _note(self, seconds: float) -> None:
        self.forward_s += self.EMA * (seconds - self.forward_s)

    def result(self, launch: Launch) -> StepOutput:
        """The step's tokens, and its log-probabilities when some request asked."""
        if isinstance(launch, Future):
            return launch.result()
        launch.done.synchronize()
        tokens: list[int] = launch.tokens.tolist()
        return tokens, launch.scores

    def close(self) -> None:
        if not self.cuda:
            self.worker.shutdown(wait=True)


class GpuTrace:
    """Per-step GPU time and the GPU's idle time before each step, from CUDA events recorded around
    every forward on the stream it runs on (benchmarks: does the overlap loop keep the GPU busy?)."""

    def __init__(self, device: torch.device, limit: int = 100_000) -> None:
        self.device = device
        self.steps: deque[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=limit)

    def start(self, fb: ForwardBatch) -> torch.cuda.Event:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(torch.cuda.current_stream(self.device))
        self.steps.append((fb.mode.value, fb.real_size, begin, end))
        return end  # the caller records it after the forward

    def read(self) -> list[TracedStep]:
        """The traced steps, oldest first."""
        out: list[TracedStep] = []
        prev_end = None
        for mode, size, begin, end in self.steps:
            end.synchronize()
            idle = prev_end.elapsed_time(begin) if prev_end is not None else None
            out.append(
                TracedStep(mode=mode, batch_size=size, gpu_ms=begin.elapsed_time(end), idle_before_ms=idle)
            )
            prev_end = end
        return out


@dataclass(frozen=True, slots=True)
class ProcessedBatch:
    """A batch whose results were processed, with when (``time.perf_counter()``) it was scheduled
    and when its results were processed: what metrics and tracing record of a step."""

    batch: ScheduleBatch
    launched: float
    processed: float


@dataclass(slots=True)
class Step:
    """What one iteration (or a drain) did: the requests that finished, the batches processed."""

    finished: list[Req] = field(default_factory=list)
    batches: list[ProcessedBatch] = field(default_factory=list)

    def then(self, later: Step) -> Step:
        return Step(self.finished + later.finished, self.batches + later.batches)


class EventLoop:
    def __init__(
        self, scheduler: BatchScheduler, runner: ModelRunner, overlap: bool, cpu_thread_min_s: float = 0.01
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.stream = _DeviceStream(runner, cpu_thread_min_s) if overlap else None
        self.in_flight: deque[tuple[ScheduleBatch, Launch, float]] = deque()  # batch, launch, launched at
        self.stats = LoopStats()
        self.trace: GpuTrace | None = None

    def enable_gpu_trace(self) -> None:
        """Record CUDA events around every forward from now on (a no-op on CPU)."""
        if self.runner.device.type == "cuda":
            self.trace = GpuTrace(self.runner.device)

    def gpu_trace(self) -> list[TracedStep]:
        """The traced steps (``GpuTrace.read``); [] on CPU or when tracing is off."""
        return self.trace.read() if self.trace is not None else []

    def step(self) -> Step:
        """One iteration: the requests that finished in it and the batches it processed."""
        return self._step_overlap() if self.overlap else self._step_normal()

    @property
    def busy(self) -> bool:
        return bool(self.in_flight) or not self.scheduler.idle

    def _step_normal(self) -> Step:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            self.scheduler.kv.await_disk_read(IDLE_READ_WAIT_S)
            return Step()
        fb = self.runner.prepare(batch)
        t1 = time.perf_counter()
        mark = self.trace.start(fb) if self.trace is not None else None
        result = self.runner.forward(fb)
        if mark is not None:
            mark.record(torch.cuda.current_stream(self.runner.device))
        tokens = result.tokens.tolist()
        scores = result.scores.to_host() if result.scores is not None else None
        t2 = time.perf_counter()
        if self.stream is not None:  # the overlap loop stepping as this one (short CPU forwards)
            self.stream.ran_inline(t2 - t1)
        finished = self.scheduler.process(batch, tokens, scores)
        t3 = time.perf_counter()
        self._account(t1 - t0 + t3 - t2, 0.0)
        return Step(finished, [ProcessedBatch(batch, t0, t3)])

    def _step_overlap(self) -> Step:
        assert self.stream is not None
        if not self.stream.overlaps or (self.in_flight and self.in_flight[-1][0].constrained):
            # Nothing to hide the host's work behind (short CPU forwards): finish what was launched
            # on the worker, then step as the normal loop does. Also when the last batch launched
            # holds a constrained request: its next mask needs the token that batch samples (the
            # grammar must accept it first), so that request's steps cannot overlap.
            return self.drain().then(self._step_normal())
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is not None:
            fb = self.runner.prepare(batch)
            self.in_flight.append((batch, self.stream.launch(fb, self.trace), t0))
        # Keep one batch running on the device while the host processes the one before it.
        done, waited = self._process_in_flight(keep=1 if batch is not None else 0)
        if batch is None and not done.batches:
            self.scheduler.kv.await_disk_read(IDLE_READ_WAIT_S)
        self._account(time.perf_counter() - t0 - waited, waited)
        return done

    def _process_in_flight(self, keep: int) -> tuple[Step, float]:
        """Process launched batches, oldest first, until ``keep`` are left; returns what that did
        and the time spent waiting for the device."""
        assert self.stream is not None
        done = Step()
        waited = 0.0
        while len(self.in_flight) > keep:
            done_batch, launch, launched = self.in_flight.popleft()
            w0 = time.perf_counter()
            tokens, scores = self.stream.result(launch)
            waited += time.perf_counter() - w0
            done.finished += self.scheduler.process(done_batch, tokens, scores)
            done.batches.append(ProcessedBatch(done_batch, launched, time.perf_counter()))
        return done, waited

    def _account(self, host: float, wait: float) -> None:
        self.stats.steps += 1
        self.stats.host_s += host
        self.stats.wait_s += wait
        self.stats.per_step_host_s.append(host)

    def drain(self) -> Step:
        """Process whatever is still in flight (shutdown, or the end of an offline run)."""
        return self._process_in_flight(keep=0)[0] if self.in_flight else Step()

    def close(self) -> None:
        self.drain()
        if self.stream is not None:
            self.stream.close()
