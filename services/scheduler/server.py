"""The scheduler pod's gRPC server: the engine's event loop behind Submit / Abort / load queries.

Threads:
    gRPC handlers   validate a request and put it in the inbox; answer load and cache queries
    engine thread   owns the BatchScheduler: drains the inbox (adds, aborts), steps the event
                    loop, and after each step sends ONE TokenBatch with every request's new tokens
    sender thread   streams the TokenBatches to the detokenizer (StreamSender), off the engine's path

Only the engine thread mutates scheduler state; handlers read a few counters (list lengths,
pool sizes), which is safe under the GIL and at worst a step stale.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from radixserve.common import telemetry
from radixserve.common.block_hash import DEFAULT_BLOCK_SIZE, root_hash
from radixserve.common.rpc import (
    SERVER_OPTIONS,
    StreamSender,
    add_health,
    pb,
    pb_grpc,
    sampling_from_proto,
    set_not_serving,
)
from radixserve.scheduler.engine import Engine
from radixserve.scheduler.kv_events import EventHub, EventSubscriber
from radixserve.scheduler.metrics import SchedulerMetrics
from radixserve.scheduler.req import FinishReason, Req
from radixserve.scheduler.tracing import SchedulerTracer

log = logging.getLogger(__name__)

SERVICE_NAME = "radixserve.v1.Scheduler"


@dataclass(slots=True)
class _Live:
    """A request admitted here and not yet ended, as the engine thread sees it."""

    req: Req
    reply_to: str
    options: Any  # pb.DetokenizeOptions, sent with the first tokens
    sent: int = 0  # output tokens already sent
    first: bool = True
    trace: dict[str, str] | None = None  # W3C headers when the request is traced


class SchedulerService(pb_grpc.SchedulerServicer):
    def __init__(
        self,
        engine: Engine,
        address: str,
        detokenizer: str,
        load_interval_s: float = 0.2,
        model_name: str = "",
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.block_size = block_size
        self.events = EventHub()
        self.publisher: Any = None  # a RedisPublisher, when the pod publishes to Redis
        self.tracer = SchedulerTracer(address, engine.config.schedule_policy) if telemetry.enabled() else None
        self.metrics = SchedulerMetrics(self)
        engine.loop.on_batch = self._on_batch
        cache = engine.scheduler.kv.cache
        if block_size > 0 and not cache.disabled:
            cache.enable_block_events(block_size, root_hash(model_name))
        self.scheduler = engine.scheduler
        self.loop = engine.loop
        self.address = address
        self.load_interval_s = load_interval_s
        self.vocab_size = engine.model_config.vocab_size
        self.out = StreamSender(
            detokenizer, lambda ch: pb_grpc.DetokenizerStub(ch).PushTokens, name="scheduler"
        )
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._rids: set[str] = set()  # admitted, not ended (handlers + engine thread, under _lock)
        # Ended, but the final message is still in the outbox (not yet handed to gRPC): still "held"
        # for Holds, so a gateway does not take a response held up here for a lost one.
        self._unsent: set[str] = set()
        self._queued_adds = 0  # in the inbox, not yet in the waiting queue
        self._live: dict[str, _Live] = {}  # engine thread only
        self.draining = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------------- handlers
    def Submit(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self.draining or self._stop.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"scheduler {self.address} is shutting down")
        if not request.rid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rid is empty")
        try:
            sp = sampling_from_proto(request.sampling)
            ids = list(request.input_ids)
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise ValueError(f"input_ids must be in [0, {self.vocab_size})")
            req = Req(request.rid, ids, sp)
            self.scheduler.check_admissible(req)  # reads the config only
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._lock:
            if request.rid in self._rids:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.rid} is already here")
            limit = self.scheduler.config.max_waiting_requests
            if len(self.scheduler.waiting) + self._queued_adds >= limit:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"scheduler {self.address}: {limit} requests waiting"
                )
            self._rids.add(request.rid)
            self._queued_adds += 1
        trace = dict(request.trace_context) if self.tracer is not None and request.trace_context else None
        options = pb.DetokenizeOptions(
            stop=list(sp.stop),
            skip_special_tokens=request.sampling.skip_special_tokens,
            prompt_tokens=len(ids),
        )
        if trace:
            options.trace_context.update(trace)
        self._inbox.put(("add", _Live(req, request.reply_to, options, trace=trace)))
        self._wake.set()
        return pb.SubmitReply()

    def Abort(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            n = sum(rid in self._rids for rid in request.rids)
        for rid in request.rids:
            self._inbox.put(("abort", (rid, request.reason or "aborted by the client")))
        self._wake.set()
        return pb.AbortReply(aborted=n)

    def Holds(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            return pb.RequestIds(
                rids=[rid for rid in request.rids if rid in self._rids or rid in self._unsent]
            )

    def GetLoad(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.load()

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Any:
        interval = request.interval_s or self.load_interval_s
        sub = self.events.subscribe(EventSubscriber()) if request.kv_events else None
        self._wake.set()  # the engine thread sends the snapshot at its next iteration
        try:
            while context.is_active() and not self._stop.is_set():
                update = pb.PodUpdate(block_size=self.block_size, model_name=self.model_name)
                if sub is None:
                    self._stop.wait(interval)
                else:
                    got = sub.take(interval)
                    if got is not None:
                        update.cleared = got[0]
                        update.stored.extend(got[1])
                        update.removed.extend(got[2])
                update.load.CopyFrom(self.load())
                yield update
        finally:
            if sub is not None:
                self.events.unsubscribe(sub)

    def MatchPrefix(self, request: Any, context: grpc.ServicerContext) -> Any:
        # The tree is the engine thread's; a read-only walk here could see a split half done.
        # Route it through the inbox and wait for the answer.
        answer: futures.Future[int] = futures.Future()
        self._inbox.put(("match", (list(request.input_ids), answer)))
        self._wake.set()
        return pb.MatchPrefixReply(cached_tokens=answer.result(timeout=30))

    def _on_batch(self, batch: Any, start: float, end: float) -> None:
        self.metrics.on_batch(batch, start, end)
        if self.tracer is not None:
            self.tracer.on_batch(batch, start, end)

    def kv_event_stats(self) -> dict[str, float]:
        p = self.publisher
        if p is None:
            return {"published": 0, "snapshots": 0, "failures": 0, "lag_s": 0.0}
        since = p.sub.pending_since
        return {
            "published": p.published,
            "snapshots": p.sub.snapshots,
            "failures": p.failures,
            "lag_s": time.monotonic() - since if since is not None else 0.0,
        }

    def load_dict(self) -> dict[str, Any]:
        lo = self.load()
        return {f.name: getattr(lo, f.name) for f in lo.DESCRIPTOR.fields}

    def load(self) -> Any:
        kv = self.scheduler.kv
        with self._lock:
            queued = self._queued_adds
        return pb.Load(
            address=self.address,
            waiting=len(self.scheduler.waiting) + queued,
            running=len(self.scheduler.running) + (self.scheduler.chunked is not None),
            kv_capacity_tokens=kv.capacity,
            kv_used_tokens=kv.capacity - kv.available(),
            kv_cached_tokens=kv.cache.evictable_size,
            max_context_len=self.scheduler.config.memory.max_context_len,
            draining=self.draining,
            max_waiting_requests=self.scheduler.config.max_waiting_requests,
        )

    # ---------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        device = self.engine.profile.device
        if device.type == "cuda":  # the current device is per thread: cuda:N here too
            torch.cuda.set_device(device)
        try:
            cache = self.scheduler.kv.cache
            while not self._stop.is_set():
                self._drain_inbox()
                if self.loop.busy:
                    finished = self.loop.step()
                    self.steps += 1
                    self._emit(finished)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
                # Aborts and finished requests change the tree too: publish after both.
                self.events.publish(cache.take_block_events(), cache.all_block_hashes)
        except BaseException as e:  # a bug or a device error: end every request with it, loudly
            log.exception("engine loop failed")
            self.error = e
            self._abort_all(f"scheduler {self.address} failed: {e!r}")

    def _drain_inbox(self) -> None:
        entries: list[Any] = []
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                with self._lock:
                    self._queued_adds -= 1
                try:
                    self.scheduler.add(arg.req)
                    self._live[arg.req.rid] = arg
                    if arg.trace is not None and self.tracer is not None:
                        self.tracer.track(arg.req.rid, arg.trace)
                except Exception as e:  # the queue filled between the check and here
                    self._forget(arg.req.rid)
                    entries.append(self._final(arg, str(e)))
            elif kind == "abort":
                rid, reason = arg
                self.scheduler.abort(rid, FinishReason.ABORT)
                lv = self._live.pop(rid, None)
                if lv is not None:
                    self._forget(rid)
                    entries.append(self._final(lv, reason))
            elif kind == "match":
                ids, answer = arg
                m = self.scheduler.kv.cache.match_prefix(np.asarray(ids, dtype=np.int32))
                answer.set_result(len(m.slots))
        if entries:
            self._send(entries)

    def _emit(self, finished: list[Req]) -> None:
        entries = []
        live = self._live
        for r in self.scheduler.running:
            lv = live.get(r.rid)
            if lv is not None:
                known = r.known_len - r.prompt_len
                if known > lv.sent:
                    entries.append(self._entry(lv, r.output_ids[lv.sent : known]))
                    lv.sent = known
        for r in finished:
            lv = live.pop(r.rid, None)
            if lv is not None:
                self._forget(r.rid)
                reason = r.finish_reason.value if r.finish_reason else FinishReason.ABORT.value
                entries.append(self._final(lv, "" if reason != "abort" else "aborted", reason))
        if entries:
            self._send(entries)

    def _final(self, lv: _Live, error: str, reason: str = FinishReason.ABORT.value) -> Any:
        r = lv.req
        self.metrics.requests.labels(reason).inc()
        if lv.trace is not None and self.tracer is not None:
            self.tracer.finish(r, reason)
        known = r.known_len - r.prompt_len
        return self._entry(lv, r.output_ids[lv.sent : known], reason, error)

    def _entry(self, lv: _Live, tokens: list[int], finish_reason: str = "", error: str = "") -> Any:
        e = pb.RequestTokens(
            rid=lv.req.rid, token_ids=tokens, finish_reason=finish_reason, error=error, reply_to=lv.reply_to
        )
        if lv.first:
            lv.options.cached_tokens = lv.req.num_cached_tokens
            e.options.CopyFrom(lv.options)
            lv.first = False
            self.metrics.prompt_tokens.inc(lv.req.prompt_len)
            self.metrics.cache_hit_tokens.inc(lv.req.num_cached_tokens)
            if lv.trace is not None and self.tracer is not None:
                self.tracer.first_token(lv.req.rid)
        lv.sent += len(tokens)
        return e

    def _send(self, entries: list[Any]) -> None:
        finals = [e.rid for e in entries if e.finish_reason]
        taken = (lambda: self._sent(finals)) if finals else None
        self.out.send(pb.TokenBatch(reqs=entries, scheduler=self.address), on_taken=taken)

    def _sent(self, rids: list[str]) -> None:
        with self._lock:
            self._unsent.difference_update(rids)

    def _forget(self, rid: str) -> None:
        """It ended; its final message goes out with the next batch (held for Holds until then)."""
        with self._lock:
            self._rids.discard(rid)
            self._unsent.add(rid)

    def _abort_all(self, reason: str) -> None:
        entries = []
        for rid, lv in list(self._live.items()):
            with contextlib.suppress(Exception):  # the loop is already broken; the client's error matters
                self.scheduler.abort(rid, FinishReason.ABORT)
            entries.append(self._final(lv, reason))
            self._forget(rid)
        self._live.clear()
        if entries:
            self._send(entries)

    # -------------------------------------------------------------------------- lifecycle
    def drain(self, timeout_s: float) -> int:
        """Stop admitting; let running requests finish for up to ``timeout_s``; abort the rest.

        Returns how many requests were aborted."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._thread.is_alive():
            with self._lock:
                if not self._rids:
                    break
            time.sleep(0.02)
        with self._lock:
            left = list(self._rids)
        for rid in left:
            self._inbox.put(
                ("abort", (rid, f"scheduler {self.address} shut down before the request finished"))
            )
        self._wake.set()
        end = time.monotonic() + 5
        while left and time.monotonic() < end and self._thread.is_alive():
            with self._lock:
                if not self._rids:
                    break
            time.sleep(0.01)
        return len(left)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.out.close()
        if self.tracer is not None:
            self.tracer.close()
        self.engine.shutdown()


def serve(
    engine: Engine,
    listen: str,
    detokenizer: str,
    advertise: str | None = None,
    workers: int = 16,
    model_name: str = "",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[grpc.Server, SchedulerService, Any]:
    """Start the engine thread and the gRPC server on ``listen``; others reach it at ``advertise``."""
    service = SchedulerService(
        engine, advertise or listen, detokenizer, model_name=model_name, block_size=block_size
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS)
    pb_grpc.add_SchedulerServicer_to_server(service, server)
    health = add_health(server, [SERVICE_NAME])
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    service.start()
    server.start()
    return server, service, health


def shutdown(server: grpc.Server, service: SchedulerService, health: Any, drain_timeout_s: float) -> None:
    """SIGTERM: not serving (probes fail, gateways stop routing here), drain, stop."""
    set_not_serving(health, [SERVICE_NAME])
    aborted = service.drain(drain_timeout_s)
    if aborted:
        log.warning("aborted %d unfinished requests at shutdown", aborted)
    service.close()
    server.stop(grace=1).wait()
