"""The gateway's core, shared by the HTTP and the gRPC front: tokenize, pick a scheduler, submit
with ``reply_to`` naming this gateway, and fan the detokenizer's results back to each client.

One client request (its lifecycle: session.py) with ``n`` choices is ``n`` scheduler requests whose
results share one queue; their rids are the request's id with the choice's index (``<rid>-<i>``).
Whatever ends a client's wait early (disconnect, error, a stop string the detokenizer found) aborts
what is still running on the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from pathlib import Path

import grpc

from radixserve.common.prefix_index import InMemoryPrefixIndex, open_index
from radixserve.common.rpc import pb
from radixserve.common.sampling import SamplingParams
from radixserve.common.service_config import GatewayConfig
from radixserve.common.tls import TLS
from radixserve.common.wire import sampling_to_proto
from radixserve.tokenizer.auth import ApiKeys
from radixserve.tokenizer.errors import ApiError, error_from_grpc, retryable, validate_sampling
from radixserve.tokenizer.metrics import GatewayMetrics
from radixserve.tokenizer.openai_api.response_store import ResponseStore, open_store
from radixserve.tokenizer.routing.failover import Failover, failover_error
from radixserve.tokenizer.routing.hold_queue import GatewayReport, HoldQueue
from radixserve.tokenizer.routing.router import Router, make_router
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle, SchedulerPool, discovers
from radixserve.tokenizer.routing.scheduler_request import (
    Delivery,
    SchedulerRequest,
    choice_seed,
    retry_rid,
    scheduler_rid,
)
from radixserve.tokenizer.text.model_text import ModelText
from radixserve.tokenizer.tracing import RequestTrace

log = logging.getLogger(__name__)

# A drained pod's stream closes once it has ended every request, but its last results travel
# another way (scheduler -> detokenizer -> here) and can arrive just after: its requests get this
# long to end before they are handled as a pod's that went away (moved, or failed).
DRAINED_GRACE_S = 5.0


class Gateway:
    def __init__(
        self,
        model_path: str | Path,
        model_name: str,
        config: GatewayConfig,
        tls: TLS | None = None,  # of the channels to the schedulers (rpc.load_tls of config.tls)
    ) -> None:
        self.api_keys = ApiKeys.from_config(config)  # first: a bad key file stops the start at once
        self.protect_metrics = config.protect_metrics
        log.info("API keys: %s", f"{len(self.api_keys)} accepted" if self.api_keys.enabled else "none (open)")
        self.lost_check_s = config.lost_response_check
        reply_to = config.advertise_address or f"localhost:{config.grpc_port}"
        routing = config.routing
        self.model_name = model_name
        # a bad parser name or template stops the start
        self.text = ModelText(
            model_path, config.tool_call_parser, config.reasoning_parser, config.chat_template
        )
        self.tokenizer = self.text.tokenizer
        self.reply_to = reply_to
        self.routing = routing
        self.index = open_index(routing.prefix_index, routing.index_key_prefix)
        memory = self.index if isinstance(self.index, InMemoryPrefixIndex) else None
        self.responses: ResponseStore = open_store(self.index, config)
        self.discover = discovers(config.schedulers, memory is None)
        self.pool = SchedulerPool(
            () if self.discover else config.schedulers,
            self,  # its PoolListener: scheduler_up / scheduler_down / scheduler_draining
            memory_index=memory,
            stale_s=config.scheduler_stale_after,
            tls=tls,
            model_name=model_name,  # a pod serving another model is refused, never routed to
            block_size=routing.block_size or None,
        )
        self.router: Router = make_router(routing, self.index, model_name)
        self.metrics = GatewayMetrics(model_name)
        # No scheduler serving (scaled to zero, starting): requests wait here (--hold-timeout).
        hold = config.max_held_requests, config.hold_timeout
        self.hold = HoldQueue(*hold, lambda: bool(self.candidates()), self.metrics.held.set)
        self.report = None if memory is not None else GatewayReport(routing, self.reply_to, self.hold)
        self.live_in_index: set[str] | None = None  # Redis: pods with a live heartbeat (None: unknown)
        self.choices: dict[str, SchedulerRequest] = {}  # live rids of this gateway
        self.failover = Failover(self, config.max_failovers)  # streams that lose their pod mid-way
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.pool.start()
        if self.pool.memory_index is None:
            self._spawn(self._sweep())
        if self.lost_check_s > 0:
            self._spawn(self._find_lost_responses())

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await self.pool.close()
        if self.report is not None:
            await asyncio.to_thread(self.report.withdraw)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _sweep(self) -> None:
        """Redis: learn which pods' heartbeats are live (with discovery: the pods to watch); remove
        the entries of expired ones."""
        while True:
            try:
                # Off the event loop: removing a dead pod's blocks takes several round trips.
                self.live_in_index = set(await asyncio.to_thread(self.index.live_pods))
                if self.discover:  # not while Redis is unreachable: the pods' streams tell then
                    await self.pool.discovered(self.live_in_index)
                self.hold.wake()  # a pod whose heartbeat came back (scheduler_up is the usual way)
                if self.report is not None:  # what the operator scales from zero on
                    await asyncio.to_thread(self.report.publish, len(self.choices))
                dead = await asyncio.to_thread(self.index.sweep)
                if dead:
                    log.warning("pods with expired heartbeats removed from the prefix index: %s", dead)
            except Exception as e:  # Redis down: route without it (the router degrades too)
                if self.live_in_index is not None:
                    log.warning("prefix index unreachable: %s", e)
                self.live_in_index = None
            await asyncio.sleep(self.routing.sweep_s)

    async def _find_lost_responses(self) -> None:
        """Fail requests whose response was lost between services instead of leaving them hanging.

        A request the gateway has heard nothing of for ``lost_check_s`` may just be slow (queued
        behind others), or its messages were lost on the way (a detokenizer that died with them).
        Its scheduler tells which: it holds a request until its final message has left for the
        detokenizer. One it no longer holds whose final message has still not come after another
        ``lost_check_s`` is not coming (not held up in the scheduler's outbox: that counts as held).
        """
        while True:
            await asyncio.sleep(self.lost_check_s / 2)
            now = time.monotonic()
            quiet: dict[SchedulerHandle, list[SchedulerRequest]] = {}
            for c in self.choices.values():
                if c.submitted and now - c.heard_at > self.lost_check_s:
                    quiet.setdefault(c.scheduler, []).append(c)
            for h, choices in quiet.items():
                asked = [(c, c.rid) for c in choices]

                def still(c: SchedulerRequest, rid: str, h: SchedulerHandle = h) -> bool:
                    # not ended, and not moved to another pod meanwhile (a re-send changes both)
                    return self.choices.get(rid) is c and c.scheduler is h

                try:
                    reply = await h.stub.Holds(pb.RequestIds(rids=[rid for _, rid in asked]), timeout=5)
                except grpc.aio.AioRpcError as e:
                    if not h.healthy:  # sent to a pod as it went down (its Watch stream has failed the rest)
                        self._fail(h, [c for c, rid in asked if still(c, rid)], e.code().name)
                    continue  # up but busy: asked again at the next check
                held = set(reply.rids)
                now = time.monotonic()
                for c, rid in asked:
                    if not still(c, rid):
                        continue
                    if rid in held:
                        c.missing_since = None
                    elif c.missing_since is None:
                        c.missing_since = now
                    elif now - c.missing_since >= self.lost_check_s:
                        self.lost(c)

    def lost(self, c: SchedulerRequest) -> None:
        self._unregister(c)
        self._abort(c.scheduler, [c.rid], "response lost")  # a no-op unless it is somehow still there
        self.metrics.lost_responses.inc()
        if c.streamed:  # some of its text reached the client: it goes on from there
            self.failover.move(c, None, "lost", "its final message never came")
            return
        log.warning("request %s: its scheduler ended it but the response never came; failing it", c.rid)
        c.queue.put_nowait((c.index, failover_error("lost", None, "")))

    def candidates(self) -> list[SchedulerHandle]:
        healthy = self.pool.healthy()
        live = self.live_in_index
        if not live:  # Redis unreachable, or empty (just restarted: heartbeats are on their way)
            return healthy
        # A pod whose heartbeat expired while others' are live is never chosen.
        return [h for h in healthy if h.address in live] or healthy

    # --------------------------------------------------------------------------- prompts
    def check_model(self, name: str) -> None:
        """Both front ends: a request for another model is a 404 (OpenAI's model_not_found)."""
        if name != self.model_name:
            raise ApiError(
                404,
                f"model {name!r} is not served here (this server serves {self.model_name!r})",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str) -> list[int]:
        return self.text.encode(text)

    def max_context(self) -> int | None:
        known = [h.load.max_context_len for h in self.pool.healthy() if h.load is not None]
        return min(known) if known else None

    # -------------------------------------------------------------------------- requests
    async def submit(
        self,
        rid: str,
        input_ids: list[int],
        sp: SamplingParams,
        n: int,
        skip_special_tokens: bool,
        trace: RequestTrace,
        queue: asyncio.Queue[Delivery],
        prompt_index: int = 0,
    ) -> list[SchedulerRequest]:
        """Send ``n`` requests for one prompt of request ``rid`` to one scheduler; raises ApiError.

        The choices' results go to ``queue`` indexed ``prompt_index * n + i``. A scheduler that
        cannot be reached (UNAVAILABLE: gone, or draining) is left out of routing and the choices go
        to another one, once."""
        validate_sampling(sp)
        trace_context = trace.carrier()
        requests = []
        for i in range(n):
            sp_i = replace(sp, seed=choice_seed(sp.seed, i)) if sp.seed is not None and n > 1 else sp
            requests.append(
                pb.TokenizedRequest(
                    input_ids=input_ids,
                    sampling=sampling_to_proto(sp_i, skip_special_tokens),
                    reply_to=self.reply_to,
                    trace_context=trace_context,
                )
            )
        failed: SchedulerHandle | None = None
        while True:
            h = self._route(input_ids, trace, avoid=failed)
            choices = []
            for k, r in enumerate(requests, start=prompt_index * n):
                # The failed pod may have taken some of them already: the second try's rids are new.
                wire_rid = scheduler_rid(rid, k) if failed is None else retry_rid(scheduler_rid(rid, k))
                choices.append(
                    SchedulerRequest(wire_rid, k, h, queue, len(input_ids), prompt_index, r, trace)
                )
            for c in choices:
                self._register(c, h)
            s0 = time.monotonic()
            try:
                for c in choices:
                    c.request.rid = c.rid
                    await h.stub.Submit(c.request, timeout=30)
            except asyncio.CancelledError:  # the client went away mid-submit
                self.release(choices, "client disconnected")
                raise
            except grpc.aio.AioRpcError as e:
                self.metrics.grpc_errors.labels(h.address, e.code().name).inc()
                self.release(choices, "submission failed")
                if e.code() != grpc.StatusCode.UNAVAILABLE or failed is not None:
                    raise error_from_grpc(e, f"scheduler {h.address}") from e
                self.pool.unreachable(h, f"Submit: {e.details()}")
                self.metrics.retries.labels("submit").inc()
                trace.child("retry", s0, time.monotonic(), _retry_attrs(h, f"Submit: {e.code().name}"))
                failed = h
                continue
            now = time.monotonic()
            for c in choices:
                c.submitted, c.heard_at = True, now
            trace.child(
                "submit", s0, time.monotonic(), {"radixserve.pod": h.address, "radixserve.choices": n}
            )
            return choices

    def _route(
        self, input_ids: Sequence[int], trace: RequestTrace, avoid: SchedulerHandle | None = None
    ) -> SchedulerHandle:
        candidates = [h for h in self.candidates() if h is not avoid]
        if not candidates:
            raise retryable("no scheduler is available")
        r0 = time.monotonic()
        h = self.router.choose(input_ids, candidates)
        r1 = time.monotonic()
        decision = self.router.decisions[-1] if self.router.decisions else None
        if decision is not None:
            self.metrics.routed(self.router.name, decision)
        trace.routed(decision, self.router.name, r0, r1)
        return h

    def _register(self, c: SchedulerRequest, h: SchedulerHandle) -> None:
        c.scheduler = h
        self.choices[c.rid] = c
        h.outstanding.add(c.rid)
        h.sent += 1  # counted in the pod's load until its next report

    def _unregister(self, c: SchedulerRequest) -> bool:
        """``c`` is no longer this gateway's to wait for; False if it already was not."""
        if self.choices.pop(c.rid, None) is None:
            return False
        c.scheduler.outstanding.discard(c.rid)
        return True

    async def _resend(
        self, c: SchedulerRequest, failed: SchedulerHandle, why: str, avoid: bool = True, label: str = "down"
    ) -> None:
        """``c`` was submitted to ``failed`` and lost there before any of its results came (or is
        handed back by a draining one): send it again, to another scheduler if ``avoid`` (under a
        new rid: a detokenizer may hold the old one's start). ``label``: the retries metric's reason."""
        if c.released:
            return
        t0 = time.monotonic()
        c.retried, c.submitted, c.missing_since = True, False, None
        try:
            h = self._route(list(c.request.input_ids), c.trace, avoid=failed if avoid else None)
        except ApiError as e:
            err = _went_away(failed, why) if avoid else retryable(f"{why}; retry the request")
            c.queue.put_nowait((c.index, err))
            log.info("request %s: no scheduler to re-send it to (%s)", c.rid, e.message)
            return
        old, c.rid = c.rid, retry_rid(c.rid)
        c.request.rid = c.rid
        self._register(c, h)
        self.metrics.retries.labels(label if avoid else "lost start").inc()
        try:
            await h.stub.Submit(c.request, timeout=30)
        except grpc.aio.AioRpcError as e:
            self.metrics.grpc_errors.labels(h.address, e.code().name).inc()
            if self._unregister(c):
                c.queue.put_nowait((c.index, error_from_grpc(e, f"scheduler {h.address} (a retry)")))
            return
        c.submitted, c.heard_at = True, time.monotonic()
        if c.released:  # the client left meanwhile; its abort may have reached the pod before this
            self._unregister(c)
            self._abort(h, [c.rid], "client disconnected")
            return
        log.info("request %s: %s before its first token; re-sent to %s", old, why, h.address)
        attrs = {**_retry_attrs(failed, why), "radixserve.retry.to": h.address}
        c.trace.child("retry", t0, time.monotonic(), attrs)

    def release(self, choices: list[SchedulerRequest], reason: str) -> None:
        """The client is done with these choices: abort those still running (no-op for ended ones)."""
        for c in choices:
            c.released = True
        by_pod: dict[SchedulerHandle, list[str]] = {}  # a request's choices can be on several pods
        for c in choices:
            if self._unregister(c):
                by_pod.setdefault(c.scheduler, []).append(c.rid)
        for h, rids in by_pod.items():
            self._abort(h, rids, reason)

    def _abort(self, h: SchedulerHandle, rids: list[str], reason: str) -> None:
        async def call() -> None:
            try:
                await h.stub.Abort(pb.AbortRequest(rids=rids, reason=reason), timeout=10)
            except grpc.aio.AioRpcError as e:
                # Gone (nothing of the requests is left to free) or only paused: then it would run
                # them on when it resumes, so they go again when its Watch stream is back.
                self.metrics.grpc_errors.labels(h.address, e.code().name).inc()
                log.info("abort of %d requests on %s failed: %s", len(rids), h.address, e.code().name)
                h.pending_aborts.update(dict.fromkeys(rids, reason))

        self._spawn(call())

    # ------------------------------------------------------------------ from the detokenizer
    def deliver(self, batch: pb.TextBatch, via: object) -> None:
        early: dict[SchedulerHandle, list[str]] = {}
        now = time.monotonic()
        for t in batch.reqs:
            c = self.choices.get(t.rid)
            if c is None:
                continue  # released: the client went away, or an abort's final message
            if t.lost_start and (c.streamed or not c.retried):
                # Its start died with a detokenizer: sent again if the client has seen nothing, else
                # continued from what it has.
                self._unregister(c)
                if t.ended_early:
                    early.setdefault(c.scheduler, []).append(t.rid)
                if c.streamed:
                    self.failover.move(c, None, "detokenizer", "the detokenizer lost its start")
                else:
                    self._spawn(self._resend(c, c.scheduler, "the detokenizer lost its start", avoid=False))
                continue
            c.delivered(t)
            c.queue.put_nowait((c.index, t))
            c.heard_at, c.via = now, via
            if t.finish_reason:
                self._unregister(c)
                if t.ended_early:  # a stop string, or a lost start: the scheduler may still run it
                    early.setdefault(c.scheduler, []).append(t.rid)
        for h, rids in early.items():
            self._abort(h, rids, "ended by the detokenizer")

    def delivery_broke(self, via: object) -> None:
        """A detokenizer's stream to this gateway ended: the requests whose text was coming through
        it lost their place (its state, what was in flight): aborted on their schedulers, continued
        from what their clients have (routing/failover.py). Those with no text yet are left alone:
        their start reaches whichever detokenizer their scheduler talks to next."""
        lost = [c for c in self.choices.values() if c.via is via]
        if not lost:
            return
        log.warning("a detokenizer stream ended: continuing the %d requests it was delivering", len(lost))
        by_pod: dict[SchedulerHandle, list[str]] = {}
        for c in lost:
            self._unregister(c)
            by_pod.setdefault(c.scheduler, []).append(c.rid)
        for h, rids in by_pod.items():
            self._abort(h, rids, "its detokenizer went away")
        for c in lost:
            self.failover.move(c, None, "detokenizer", "its detokenizer went away")

    def scheduler_up(self, h: SchedulerHandle) -> None:
        """``h`` reports again: what could not be aborted on it while it was away is aborted now (a
        pod that was only paused still holds those requests; a restarted one ignores the rids). The
        requests held for want of a scheduler go now."""
        self.hold.wake()
        if h.pending_aborts:
            pending, h.pending_aborts = h.pending_aborts, {}
            for reason in set(pending.values()):
                self._abort(h, [rid for rid, r in pending.items() if r == reason], reason)

    def scheduler_draining(self, h: SchedulerHandle) -> None:
        """``h`` drains (SIGTERM; the pool routes nothing new there). Its requests no text of which
        reached a client yet are handed back: aborted there and re-sent to another scheduler now,
        rather than wait behind its running ones and risk its drain deadline (the client has seen
        nothing, so only the work done is lost). Streaming ones finish there. With no other
        scheduler to take them, all stay."""
        if not [o for o in self.candidates() if o is not h]:
            return
        idle = [
            c
            for rid in list(h.outstanding)
            if (c := self.choices.get(rid)) is not None and c.submitted and not c.streamed and not c.retried
        ]
        if idle:
            log.info("scheduler %s drains: %d requests without text yet move elsewhere", h.address, len(idle))
            self._fail(h, idle, "it is draining", label="drain")

    def scheduler_down(self, h: SchedulerHandle, why: str) -> None:
        """``h``'s Watch stream broke or went quiet: its requests move or fail, none waits on it.

        One that was draining ended every request before its stream closed (finished, or aborted
        at its deadline with a reason), but their last results may still be on the way (through
        the detokenizer): its requests get ``DRAINED_GRACE_S`` to end before they move or fail."""
        self.metrics.grpc_errors.labels(h.address, "STREAM_BROKEN").inc()
        choices = [c for rid in list(h.outstanding) if (c := self.choices.get(rid)) is not None]
        h.outstanding.clear()
        if h.draining and choices:
            self._spawn(self._fail_later(h, choices, why, DRAINED_GRACE_S))
        else:
            self._fail(h, choices, why)

    async def _fail_later(
        self, h: SchedulerHandle, choices: list[SchedulerRequest], why: str, delay_s: float
    ) -> None:
        await asyncio.sleep(delay_s)
        late = [c for c in choices if self.choices.get(c.rid) is c]  # not ended, not moved meanwhile
        if late:
            log.warning("%d requests of drained scheduler %s never ended; failing them", len(late), h.address)
            self._fail(h, late, why)

    def _fail(
        self, h: SchedulerHandle, choices: list[SchedulerRequest], why: str, label: str = "down"
    ) -> None:
        """Re-send the submitted choices no result of which came yet, once; continue the streaming
        ones from what their clients have (routing/failover.py); fail the others with a retryable
        error. (A choice still being submitted is left to its Submit call.)"""
        moved, streams = [], []  # aborted there; continued elsewhere
        for c in choices:
            if not c.submitted:
                continue
            self._unregister(c)
            moved.append(c.rid)
            if c.streamed:
                streams.append(c)
            elif c.retried:
                c.queue.put_nowait((c.index, _went_away(h, why)))
            else:
                self._spawn(self._resend(c, h, why, label=label))
        if moved:  # a pod that only went quiet may come back: it must not run them too
            self._abort(h, moved, f"its gateway gave up on this scheduler ({why})")
        for c in streams:
            self.failover.move(c, h, "scheduler", why)


def _went_away(h: SchedulerHandle, why: str) -> ApiError:
    return retryable(f"scheduler {h.address} went away mid-request ({why}); retry the request")


def _retry_attrs(h: SchedulerHandle, why: str) -> dict[str, str]:
    return {"radixserve.retry.from": h.address, "radixserve.retry.reason": why}
