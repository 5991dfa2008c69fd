"""The scheduler pod's part of a request's trace, made after the fact.

While a traced request runs, the engine thread only notes times (arrival, admission, each prefill
chunk, first token); when it ends, a worker thread turns them into spans under the gateway's span
(the request's trace_context):

    scheduler (arrival -> end; pod, cached tokens, retractions, finish reason)
      queue   (arrival -> first admission)
      kv.load_back (per load of its prefix back from the host tier: tokens, tier, bytes; the copies
                    of the step before its first prefill chunk, or of that chunk's own step)
      prefill (one per chunk: tokens, prefix already in KV)
      decode  (first token -> end; output tokens)

Nothing here runs unless tracing is on (radixserve.common.telemetry) and the request came with a
trace context.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.common import telemetry
from radixserve.scheduler.batch import ForwardMode, ScheduleBatch
from radixserve.scheduler.req import Req

if TYPE_CHECKING:
    from radixserve.scheduler.memory.host_pool import KVLoad

_PERF_TO_MONO = time.monotonic() - time.perf_counter()


@dataclass(slots=True)
class _Timeline:
    carrier: dict[str, str]
    chunks: list[tuple[float, float, int, int]] = field(default_factory=list)  # start, end, tokens, prefix
    first_token: float | None = None
    # its loads as the steps that ran them saw them (the load, its tokens, the step's end: monotonic),
    # made spans when it ends (their times are known by then: its prefill waited for them)
    queued_loads: list[tuple[KVLoad, int, float]] = field(default_factory=list)
    loads: list[_LoadBack] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _LoadBack:
    start: float  # time.monotonic()
    end: float
    tokens: int
    nbytes: int
    tier: str


def _load_back(load: KVLoad, tokens: int, end: float) -> _LoadBack:
    """A request's ``tokens`` of the step's ``load``, whose step ended at ``end`` (monotonic): from
    when the copies began for as long as they took (unknown yet: to the step's end)."""
    seconds = load.seconds()
    begin = load.start + _PERF_TO_MONO if load.start is not None else end
    done = begin + seconds if seconds is not None else end
    return _LoadBack(begin, done, tokens, tokens * load.nbytes // load.tokens, load.from_tier)


class SchedulerTracer:
    def __init__(self, pod: str, policy: str) -> None:
        self.pod, self.policy = pod, policy
        self._timelines: dict[str, _Timeline] = {}  # engine thread only
        self._done: queue.SimpleQueue[tuple[_Timeline, Req, str, float] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="tracing", daemon=True)
        self._worker.start()

    # engine thread ------------------------------------------------------------------------------
    def track(self, rid: str, carrier: dict[str, str]) -> None:
        self._timelines[rid] = _Timeline(carrier)

    def on_batch(self, batch: ScheduleBatch, start: float, end: float) -> None:
        if not self._timelines:
            return
        start, end = start + _PERF_TO_MONO, end + _PERF_TO_MONO
        if batch.kv_load is not None:  # (any batch: the requests it loads for wait for it, not in it)
            for r, tokens in batch.kv_loads_for:
                tl = self._timelines.get(r.rid)
                if tl is not None:
                    tl.queued_loads.append((batch.kv_load, tokens, end))
        if batch.mode is not ForwardMode.EXTEND:
            return
        lens, prefixes = batch.extend_lens.tolist(), batch.prefix_lens.tolist()
        for r, n, p in zip(batch.reqs, lens, prefixes, strict=True):
            tl = self._timelines.get(r.rid)
            if tl is not None:
                tl.chunks.append((start, end, n, p))

    def first_token(self, rid: str) -> None:
        tl = self._timelines.get(rid)
        if tl is not None and tl.first_token is None:
            tl.first_token = time.monotonic()

    def finish(self, req: Req, reason: str) -> None:
        tl = self._timelines.pop(req.rid, None)
        if tl is not None:
            tl.loads = [_load_back(*q) for q in tl.queued_loads]  # on this thread: KVLoad is not shared
            self._done.put((tl, req, reason, time.monotonic()))

    # worker ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while (item := self._done.get()) is not None:
            tl, req, reason, end = item
            try:
                self._spans(tl, req, reason, end)
            except Exception:  # a tracing bug must never take the pod down
                import logging

                logging.getLogger(__name__).exception("could not record a trace")

    def _spans(self, tl: _Timeline, req: Req, reason: str, end: float) -> None:
        parent = telemetry.extract(tl.carrier)
        outputs = len([t for t in req.output_ids if t >= 0])
        top = telemetry.span_between(
            "scheduler",
            parent,
            req.arrival_time,
            end,
            {
                "radixserve.rid": req.rid,  # the gateway's request id, with the choice's index
                "radixserve.pod": self.pod,
                "radixserve.schedule_policy": self.policy,
                "radixserve.cached_tokens": req.num_cached_tokens,
                "radixserve.retractions": req.retractions,
                "radixserve.prefill_chunks": len(tl.chunks),
                "gen_ai.usage.input_tokens": req.prompt_len,
                "gen_ai.usage.output_tokens": outputs,
                "gen_ai.response.finish_reasons": [reason],
            },
        )
        admitted = req.admit_time if req.admit_time is not None else end
        telemetry.span_between(
            "queue", top, req.arrival_time, admitted, {"radixserve.queue_wait_s": admitted - req.arrival_time}
        )
        for lb in tl.loads:
            telemetry.span_between(
                "kv.load_back",
                top,
                lb.start,
                lb.end,
                {
                    "radixserve.kv.tokens": lb.tokens,
                    "radixserve.kv.tier": lb.tier,
                    "radixserve.kv.bytes": lb.nbytes,
                },
            )
        for i, (s, e, n, p) in enumerate(tl.chunks):
            telemetry.span_between(
                "prefill",
                top,
                s,
                e,
                {"radixserve.chunk": i, "radixserve.chunk_tokens": n, "radixserve.prefix_tokens": p},
            )
        if tl.first_token is not None:
            telemetry.span_between(
                "decode", top, tl.first_token, end, {"gen_ai.usage.output_tokens": outputs}
            )

    def close(self) -> None:
        self._done.put(None)
        self._worker.join(5)
