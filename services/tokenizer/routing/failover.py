"""Mid-stream failover: a stream whose scheduler or detokenizer died goes on elsewhere, and its client
sees one uninterrupted stream.

Before its first token a request is simply sent again (gateway.py, ``_resend``). After it, the
gateway holds all a stream needs to go on: the request (prompt, sampling), and every token and
character it delivered (``SchedulerRequest.output_ids`` / ``text_chars``). ``Failover.move`` sends a
continuation under a new rid: the same request with ``continuation`` = what the client has. The
scheduler runs it as if it had generated those tokens itself (scheduler/worker.py, ``Continuation``):

- token budget and min tokens over the whole output; penalties over the whole output;
- a constrained request's grammar replayed over the delivered tokens;
- seeded draws: each token's generator is seeded by (seed, output position), so draw k of the
  continuation is draw k of the undisturbed run (greedy is the argmax at the same position);
- logprobs for the new tokens only; prompt logprobs not again (they came with the first message).

The detokenizer rebuilds its state from those tokens and sends on from the client's last character;
the usage counts each token once (the detokenizer counts the delivered tokens as output, the
gateway keeps the first run's cached-token count).

Causes: ``scheduler`` (its pod went down or stopped answering; the continuation goes to another
pod), ``detokenizer`` (the stream delivering its text broke, or a detokenizer never saw its start;
any pod, the router usually picks the one holding its prefix), ``lost`` (its pod ended it but the
final message never came). A stream moves at most ``max_failovers`` times; one that cannot move
(the limit, no scheduler within ``FAILOVER_WAIT_S``, a pod that refuses it) ends with the retryable
error it got before failover existed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import TYPE_CHECKING

import grpc

from radixserve.common.rpc import pb
from radixserve.tokenizer.errors import ApiError, error_from_grpc, retryable
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle
from radixserve.tokenizer.routing.scheduler_request import SchedulerRequest

if TYPE_CHECKING:
    from radixserve.tokenizer.gateway import Gateway

log = logging.getLogger(__name__)

# How long a moved stream waits for a scheduler to take it (a lone pod restarting takes seconds).
FAILOVER_WAIT_S = 15.0
CAUSES = ("scheduler", "detokenizer", "lost")


def failover_rid(rid: str, n: int) -> str:
    """The rid of a stream's ``n``-th continuation: its own, since the pod and detokenizer it left
    may still know (and send for) the old one."""
    return f"{_FAILOVER_SUFFIX.sub('', rid)}.f{n}"


_FAILOVER_SUFFIX = re.compile(r"\.f\d+$")


def failover_error(cause: str, failed: SchedulerHandle | None, why: str) -> ApiError:
    """What a stream that cannot move ends with (a retryable 503 / SSE error / UNAVAILABLE)."""
    if cause == "scheduler" and failed is not None:
        return retryable(f"scheduler {failed.address} went away mid-request ({why}); retry the request")
    if cause == "lost":
        return retryable(
            "the response was lost between the gateway's services (a detokenizer restart?); retry the request"
        )
    return retryable(
        f"the detokenizer delivering this response went away mid-request ({why}); retry the request"
    )


def continuation_request(c: SchedulerRequest, rid: str) -> pb.TokenizedRequest:
    """``c``'s request going on from what its client has."""
    r = pb.TokenizedRequest()
    r.CopyFrom(c.request)
    r.rid = rid
    r.sampling.ClearField("prompt_logprobs")  # sent with the first message already
    r.ClearField("continuation")
    r.continuation.output_ids.extend(c.output_ids)
    r.continuation.text_chars = c.text_chars
    return r


class Failover:
    def __init__(self, gateway: Gateway, max_failovers: int) -> None:
        self.gateway = gateway
        self.max_failovers = max_failovers

    def move(self, c: SchedulerRequest, failed: SchedulerHandle | None, cause: str, why: str) -> None:
        """Continue ``c`` (already unregistered by the caller) elsewhere, or end it with the error it
        ended with before failover existed. ``failed``: the pod that died (``cause`` scheduler), not
        to send it to."""
        gw = self.gateway
        error = failover_error(cause, failed, why)
        if c.released:
            return
        budget = c.request.sampling.max_new_tokens if c.request.sampling.HasField("max_new_tokens") else None
        if budget is not None and len(c.output_ids) >= budget:  # it had all its tokens: only the end was lost
            end = pb.RequestText(rid=c.rid, finish_reason="length", prompt_tokens=c.prompt_tokens)
            end.completion_tokens, end.cached_tokens = len(c.output_ids), c.cached_tokens
            c.queue.put_nowait((c.index, end))
            return
        if c.failovers >= self.max_failovers:
            gw.metrics.failovers.labels(cause, "refused").inc()
            log.warning("request %s: %s; it moved %d times already: failing it", c.rid, why, c.failovers)
            c.queue.put_nowait((c.index, error))
            return
        gw._spawn(self._move(c, failed, cause, why, error))

    async def _move(
        self, c: SchedulerRequest, failed: SchedulerHandle | None, cause: str, why: str, error: ApiError
    ) -> None:
        gw = self.gateway
        t0 = time.monotonic()
        c.failovers += 1
        c.via, c.submitted, c.missing_since = None, False, None
        rid = failover_rid(c.rid, c.failovers)
        request = continuation_request(c, rid)
        deadline = t0 + FAILOVER_WAIT_S
        avoid = failed
        sequence = [*c.request.input_ids, *c.output_ids]  # routed by all of it: a pod may hold it all
        while True:
            try:
                h = gw._route(sequence, c.trace, avoid=avoid)
            except ApiError:  # no scheduler now: one may come back (a restarted pod) before the deadline
                if time.monotonic() > deadline or c.released:
                    self._failed(c, cause, why, "no scheduler to take it", error)
                    return
                await asyncio.sleep(0.2)
                avoid = failed if time.monotonic() < t0 + 1.0 else None  # later: its restarted self too
                continue
            c.rid = request.rid
            gw._register(c, h)
            try:
                await h.stub.Submit(request, timeout=30)
            except grpc.aio.AioRpcError as e:
                gw.metrics.grpc_errors.labels(h.address, e.code().name).inc()
                gw._unregister(c)
                if e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    gw.pool.unreachable(h, f"Submit: {e.details()}")
                    avoid = h
                    continue
                refused = error_from_grpc(e, f"scheduler {h.address}").message
                self._failed(c, cause, why, refused, error)
                return
            break
        c.submitted, c.heard_at = True, time.monotonic()
        if c.released:  # the client left meanwhile
            gw._unregister(c)
            gw._abort(h, [c.rid], "client disconnected")
            return
        gw.metrics.failovers.labels(cause, "moved").inc()
        log.info(
            "request %s: its %s %s (%s) after %d tokens; continued on %s as %s",
            c.rid,
            cause,
            failed.address if failed is not None else "",
            why,
            len(c.output_ids),
            h.address,
            rid,
        )
        c.trace.child(
            "failover",
            t0,
            time.monotonic(),
            {
                "radixserve.failover.cause": cause,
                "radixserve.failover.reason": why,
                "radixserve.failover.from": failed.address if failed is not None else "",
                "radixserve.failover.to": h.address,
                "radixserve.failover.delivered_tokens": len(c.output_ids),
                "radixserve.failover.count": c.failovers,
            },
        )

    def _failed(self, c: SchedulerRequest, cause: str, why: str, then: str, error: ApiError) -> None:
        self.gateway.metrics.failovers.labels(cause, "failed").inc()
        log.warning("request %s: %s; cannot continue it (%s)", c.rid, why, then)
        c.queue.put_nowait((c.index, error))
