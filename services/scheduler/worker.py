"""EngineWorker: the engine thread and the life of every request admitted to this pod.

The gRPC servicer (server.py) turns protobuf into the typed messages below and back; the worker
never sees protobuf. Threads:

    callers         ``submit`` / ``abort`` / ``match_prefix`` / ``holds`` / ``load``: check what can
                    be checked at once, put a message in the inbox, answer from a few counters
    engine thread   owns the BatchScheduler: drains the inbox (adds, aborts, prefix queries), steps
                    the event loop, and after each step hands ONE list of ``TokenUpdate`` (every
                    request's new tokens) to ``emit``

Only the engine thread mutates scheduler state; callers read a few counters (list lengths, pool
sizes), which is safe under the GIL and at worst a step stale.

Tensor parallelism hangs off this seam: rank 0's worker keeps the scheduler and the request
lifecycle; the runner hands each step's plan to the other ranks, which only run the model
(tensor_parallel.py). A rank that dies fails the engine loop: ``on_failure`` then stops the pod.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.common.block_hash import DEFAULT_BLOCK_SIZE, root_hash
from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch_scheduler import QueueFullError
from radixserve.scheduler.continuation import Continuation, continued
from radixserve.scheduler.engine import Engine
from radixserve.scheduler.event_loop import ProcessedBatch
from radixserve.scheduler.kv_events import EventHub
from radixserve.scheduler.metrics import SchedulerMetrics
from radixserve.scheduler.req import FinishReason, Req, TokenLogprob
from radixserve.scheduler.tracing import SchedulerTracer

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ messages in
@dataclass(frozen=True, slots=True)
class DetokenizeOptions:
    """What the detokenizer needs to know of a request; sent with its first tokens."""

    stop: tuple[str, ...]
    skip_special_tokens: bool
    prompt_tokens: int
    trace_context: dict[str, str] | None = None
    include_stop: bool = False  # SamplingParams.include_stop_str
    min_tokens: int = 0  # SamplingParams.min_new_tokens: stop strings wait for them
    continuation: Continuation | None = None


@dataclass(frozen=True, slots=True)
class Submit:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    reply_to: str  # the gateway the detokenizer delivers this request's text to
    skip_special_tokens: bool = True
    trace_context: dict[str, str] | None = None  # W3C headers when the request is traced
    continuation: Continuation | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str
    reason: str


@dataclass(frozen=True, slots=True)
class MatchPrefix:
    input_ids: list[int]
    answer: futures.Future[int]


class ShuttingDown(Exception):
    """The pod drains or stops: no new requests (the gateway sends them elsewhere)."""


class AlreadyHere(Exception):
    """A request with this rid is already admitted here."""


# ----------------------------------------------------------------------------- messages out
@dataclass(slots=True)
class TokenUpdate:
    """One request's new output of one engine step (its final one carries ``finish_reason``)."""

    rid: str
    token_ids: list[int]
    reply_to: str
    finish_reason: str = ""
    error: str = ""
    options: DetokenizeOptions | None = None  # with a request's first update only
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (first update)
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first update (echo)


@dataclass(frozen=True, slots=True)
class PodLoad:
    """What the pod reports to gateways and the prefix index (the fields of ``pb.Load``)."""

    address: str
    waiting: int
    running: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    kv_cached_tokens: int
    max_context_len: int
    draining: bool
    max_waiting_requests: int
    disk_location: str = ""  # the shared disk directory's id its disk-tier blocks are indexed under


# ``emit(updates, on_taken)``: hand a step's updates to the detokenizer; ``on_taken`` runs once the
# message has left this process (final updates are "held" for ``holds`` until then).
Emit = Callable[[list[TokenUpdate], Callable[[], None] | None], None]


@dataclass(slots=True)
class _Live:
    """A request admitted here and not yet ended, as the engine thread sees it."""

    req: Req
    reply_to: str
    options: DetokenizeOptions
    sent: int = 0  # output tokens already sent
    first: bool = True


# A checked Submit (as the _Live it becomes) on its way to the engine thread, or another message.
Message = _Live | Abort | MatchPrefix


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        address: str,
        emit: Emit,
        metrics: SchedulerMetrics,
        tracer: SchedulerTracer | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        model_name: str = "",
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """``block_size`` > 0: the radix cache reports its full blocks (hashed from ``model_name``'s
        root) as events, published to ``events`` after every iteration. ``on_failure``: called once,
        on the engine thread, after a failure has ended every request with its error (the scheduler
        process then exits non-zero: scheduler/__main__.py)."""
        self.engine = engine
        self.scheduler = engine.scheduler
        self.loop = engine.loop
        self.address = address
        self.emit = emit
        self.metrics = metrics
        self.tracer = tracer
        self.events = EventHub()  # the radix cache's block events, for Watch streams and Redis
        cache = engine.scheduler.kv.cache
        if block_size > 0 and not cache.disabled:
            cache.enable_block_events(block_size, root_hash(model_name))
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._rids: set[str] = set()  # admitted, not ended (callers + engine thread, under _lock)
        # Ended, but the final message is still in the outbox (not yet handed to gRPC): still "held"
        # for holds(), so a gateway does not take a response held up here for a lost one.
        self._unsent: set[str] = set()
        self._queued_adds = 0  # in the inbox, not yet in the waiting queue
        self._live: dict[str, _Live] = {}  # engine thread only
        self.draining = False
        self.stopped = threading.Event()  # set by stop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        # When the engine thread last finished an iteration (time.monotonic(); one write per step):
        # the liveness check (liveness.py) compares it with the clock while requests are here.
        # The engine was built (and warmed up) before this worker: its start counts from now.
        self.beat = time.monotonic()
        self.error: BaseException | None = None
        self.on_failure = on_failure

    def start(self) -> None:
        self._thread.start()

    def stop_admitting(self) -> None:
        """New requests are refused from now on (Submit: UNAVAILABLE, so gateways send them elsewhere);
        the running ones go on."""
        self.draining = True

    @property
    def stopping(self) -> bool:
        return self.draining or self.stopped.is_set()

    @property
    def thread_id(self) -> int | None:
        """The engine thread's ident (None before it starts): where a stuck step's stack is found."""
        return self._thread.ident

    # --------------------------------------------------------------------------- callers
    def submit(self, msg: Submit) -> None:
        """Admit a request, or raise: ShuttingDown, ValueError (bad request), AlreadyHere,
        QueueFullError (the waiting queue is full)."""
        if self.stopping or self.error is not None:
            raise ShuttingDown(f"scheduler {self.address} is shutting down")
        if not msg.rid:
            raise ValueError("rid is empty")
        ids = self.engine.check_vocab(msg.input_ids, msg.sampling)  # before the int32 Req holds them
        req = Req(msg.rid, ids.astype(np.int32), msg.sampling)
        self.scheduler.check_admissible(req)  # reads the config only
        self.engine.attach_grammar(req)  # compiles on the grammar threads; this caller waits, not the engine
        if msg.continuation is not None:
            continued(req, msg.continuation, self.engine)
        with self._lock:
            if msg.rid in self._rids:
                raise AlreadyHere(f"request {msg.rid} is already here")
            limit = self.scheduler.config.max_waiting_requests
            if len(self.scheduler.waiting) + self._queued_adds >= limit:
                raise QueueFullError(f"scheduler {self.address}: {limit} requests waiting")
            self._rids.add(msg.rid)
            self._queued_adds += 1
        trace = msg.trace_context if self.tracer is not None and msg.trace_context else None
        options = DetokenizeOptions(
            stop=tuple(msg.sampling.stop),
            skip_special_tokens=msg.skip_special_tokens,
            prompt_tokens=len(msg.input_ids),
            trace_context=trace,
            include_stop=msg.sampling.include_stop_str,
            min_tokens=msg.sampling.min_new_tokens,
            continuation=msg.continuation,
        )
        self._put(_Live(req, msg.reply_to, options, sent=len(req.output_ids)))

    def abort(self, rids: list[str], reason: str) -> int:
        """End these requests (those still here); returns how many were here."""
        with self._lock:
            n = sum(rid in self._rids for rid in rids)
        for rid in rids:
            self._inbox.put(Abort(rid, reason))
        self._wake.set()
        return n

    def holds(self, rids: list[str]) -> list[str]:
        """Those of ``rids`` still here, or ended with their final message not yet sent."""
        with self._lock:
            return [rid for rid in rids if rid in self._rids or rid in self._unsent]

    def match_prefix(self, input_ids: list[int], timeout_s: float = 30) -> int:
        """Tokens of ``input_ids`` in the prefix cache. The tree is the engine thread's (a read-only
        walk here could see a split half done), so the engine thread answers."""
        answer: futures.Future[int] = futures.Future()
        self._put(MatchPrefix(input_ids, answer))
        return answer.result(timeout=timeout_s)

    def wake(self) -> None:
        """Let the engine thread run an iteration now (a new Watch stream wants its snapshot)."""
        self._wake.set()

    def load(self) -> PodLoad:
        kv = self.scheduler.kv
        with self._lock:
            queued = self._queued_adds
        return PodLoad(
            address=self.address,
            waiting=len(self.scheduler.waiting) + queued,
            running=len(self.scheduler.running) + (self.scheduler.chunked is not None),
            kv_capacity_tokens=kv.capacity,
            kv_used_tokens=kv.capacity - kv.available(),
            kv_cached_tokens=kv.cache.evictable_size,
            max_context_len=self.scheduler.config.memory.max_context_len,
            draining=self.draining,
            max_waiting_requests=self.scheduler.config.max_waiting_requests,
            disk_location=kv.cache.disk_location,
        )

    def seconds_since_step(self) -> float:
        """How long the engine thread has had work (requests here, or messages in its inbox) without
        finishing an iteration; 0 while it has none. An idle engine thread iterates every 50 ms, so
        this grows only when a step (or the inbox's handling) does not return: a hung kernel, a
        collective waiting on a silent peer."""
        if not self._rids and self._inbox.empty():  # a set's length: safe to read without the lock
            return 0.0
        return max(0.0, time.monotonic() - self.beat)

    def _put(self, msg: Message) -> None:
        self._inbox.put(msg)
        self._wake.set()

    # ----------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        device = self.engine.profile.device
        if device.type == "cuda":  # the current device is per thread: cuda:N here too
            torch.cuda.set_device(device)
        try:
            cache = self.scheduler.kv.cache
            self.beat = time.monotonic()
            while not self.stopped.is_set():
                self._drain_inbox()
                if self.loop.busy:
                    step = self.loop.step()
                    self.steps += 1
                    self._record(step.batches)
                    self._emit_step(step.finished)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
                # Aborts and finished requests change the tree too: publish after both.
                self.events.publish(cache.take_block_events(), cache.block_snapshot)
                self.beat = time.monotonic()
        except BaseException as e:  # a bug or a device error: end every request with it, loudly
            log.exception("engine loop failed")
            self.error = e
            followers = self.engine.followers
            # the cause, if known: a rank that died (its exit can trail the collective's error a little)
            why = (followers.dead(wait_s=2.0) if followers is not None else None) or repr(e)
            self._abort_all(f"scheduler {self.address} failed: {why}")
            if self.on_failure is not None:
                self.on_failure(f"engine loop failed: {why}")

    def _drain_inbox(self) -> None:
        if self._inbox.empty():  # most iterations (the engine thread is the only consumer)
            return
        updates: list[TokenUpdate] = []
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, _Live):
                self._admit(msg, updates)
            elif isinstance(msg, Abort):
                self.scheduler.abort(msg.rid, FinishReason.ABORT)
                lv = self._live.pop(msg.rid, None)
                if lv is not None:
                    updates.append(self._final(lv, msg.reason))
            else:
                m = self.scheduler.kv.cache.match_prefix(np.asarray(msg.input_ids, dtype=np.int32))
                msg.answer.set_result(m.length)  # a host-tier part is loaded back, not computed
        if updates:
            self._send(updates)

    def _admit(self, lv: _Live, updates: list[TokenUpdate]) -> None:
        with self._lock:
            self._queued_adds -= 1
        try:
            self.scheduler.add(lv.req)
        except Exception as e:  # the queue filled between the check and here
            updates.append(self._final(lv, str(e)))
            return
        self._live[lv.req.rid] = lv
        trace = lv.options.trace_context  # set only when this pod traces
        if trace is not None and self.tracer is not None:
            self.tracer.track(lv.req.rid, trace)

    def _emit_step(self, finished: list[Req]) -> None:
        updates = []
        live = self._live
        for r in self.scheduler.running:
            lv = live.get(r.rid)
            if lv is not None:
                known = r.known_len - r.prompt_len
                if known > lv.sent:
                    updates.append(self._update(lv, r.output_ids[lv.sent : known]))
        for r in finished:
            lv = live.pop(r.rid, None)
            if lv is not None:
                reason = r.finish_reason.value if r.finish_reason else FinishReason.ABORT.value
                updates.append(self._final(lv, "" if reason != "abort" else "aborted", reason))
        if updates:
            self._send(updates)

    def _final(self, lv: _Live, error: str, reason: str = FinishReason.ABORT.value) -> TokenUpdate:
        """The request's last update; it is no longer here (but held for holds() until sent)."""
        r = lv.req
        self._forget(r.rid)
        self.metrics.ended(reason)
        if lv.options.trace_context is not None and self.tracer is not None:
            self.tracer.finish(r, reason)
        known = r.known_len - r.prompt_len
        return self._update(lv, r.output_ids[lv.sent : known], reason, error)

    def _update(self, lv: _Live, tokens: list[int], finish_reason: str = "", error: str = "") -> TokenUpdate:
        r = lv.req
        u = TokenUpdate(r.rid, tokens, lv.reply_to, finish_reason, error)
        if r.sampling.logprobs is not None:
            u.logprobs = r.output_logprobs[lv.sent : lv.sent + len(tokens)]
        if lv.first:
            u.options, u.cached_tokens = lv.options, lv.req.num_cached_tokens
            scored = r.prompt_logprobs
            if scored is not None and all(e is not None for e in scored[1:]):  # not if it ended before
                u.prompt_logprobs = scored
            lv.first = False
            self.metrics.prompt_tokens.inc(lv.req.prompt_len)
            self.metrics.cache_hit_tokens.inc(lv.req.num_cached_tokens)
            if lv.options.trace_context is not None and self.tracer is not None:
                self.tracer.first_token(lv.req.rid)
        lv.sent += len(tokens)
        return u

    def _send(self, updates: list[TokenUpdate]) -> None:
        finals = [u.rid for u in updates if u.finish_reason]
        taken = (lambda: self._sent(finals)) if finals else None
        self.emit(updates, taken)

    def _sent(self, rids: list[str]) -> None:
        with self._lock:
            self._unsent.difference_update(rids)

    def _forget(self, rid: str) -> None:
        """It ended; its final message goes out with the next batch (held for holds() until then)."""
        with self._lock:
            self._rids.discard(rid)
            self._unsent.add(rid)

    def _abort_all(self, reason: str) -> None:
        updates = []
        for rid, lv in list(self._live.items()):
            with contextlib.suppress(Exception):  # the loop is already broken; the client's error matters
                self.scheduler.abort(rid, FinishReason.ABORT)
            updates.append(self._final(lv, reason))
        self._live.clear()
        if updates:
            self._send(updates)

    def _record(self, batches: list[ProcessedBatch]) -> None:
        """Metrics and tracing of the batches a step processed (off the step's own path)."""
        for b in batches:
            self.metrics.on_batch(b.batch, b.launched, b.processed)
            if self.tracer is not None:
                self.tracer.on_batch(b.batch, b.launched, b.processed)

    # -------------------------------------------------------------------------- lifecycle
    def drain(self, timeout_s: float) -> int:
        """Stop admitting; let running requests finish for up to ``timeout_s``; abort the rest.

        Returns how many requests were aborted. Done means every request's final message has left
        for the detokenizer too: a gateway that sees this pod's Watch stream end then has, or is
        about to get, every result."""
        t0 = time.monotonic()
        self.stop_admitting()
        with self._lock:
            held = len(self._rids)
        self._wait_until_empty(t0 + timeout_s, 0.02)
        with self._lock:
            left = list(self._rids)
        self.abort(left, f"scheduler {self.address} shut down before the request finished")
        if left:
            self._wait_until_empty(time.monotonic() + 5, 0.01)
        log.info(
            "drained in %.2f s: %d requests held at the start, %d running at the %.0f s deadline (aborted)",
            time.monotonic() - t0,
            held,
            len(left),
            timeout_s,
        )
        return len(left)

    def _wait_until_empty(self, deadline: float, poll_s: float) -> None:
        while time.monotonic() < deadline and self._thread.is_alive():
            with self._lock:
                if not self._rids and not self._unsent:
                    return
            time.sleep(poll_s)

    def join(self, timeout_s: float) -> bool:
        """Wait for the engine thread to end (after a failure); True if it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """End the engine thread (after its current iteration); its last updates are emitted."""
        self.stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def close(self) -> None:
        self.stop()
        if self.tracer is not None:
            self.tracer.close()
        self.engine.shutdown()
