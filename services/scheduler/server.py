"""The scheduler pod's gRPC servicer: protobuf at the edge, the EngineWorker (worker.py) behind it.

``Submit`` / ``Abort`` / ``Holds`` / ``MatchPrefix`` turn into the worker's typed calls; the
worker's ``TokenUpdate`` lists become one ``TokenBatch`` per engine step, streamed to the
detokenizer by a sender thread (StreamSender), off the engine's path. ``GetLoad`` and ``Watch``
report the worker's load (and, for Watch, the radix cache's block events).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1.health import HealthServicer

from radixserve.common import telemetry
from radixserve.common.block_hash import DEFAULT_BLOCK_SIZE
from radixserve.common.health import add_health, set_not_serving
from radixserve.common.rpc import SERVER_OPTIONS, listen, pb, pb_grpc
from radixserve.common.stream_sender import StreamSender
from radixserve.common.tls import TLS
from radixserve.common.wire import logprobs_to_proto, sampling_from_proto
from radixserve.scheduler.batch_scheduler import QueueFullError
from radixserve.scheduler.continuation import Continuation
from radixserve.scheduler.engine import Engine
from radixserve.scheduler.kv_events import EventSubscriber, RedisPublisher
from radixserve.scheduler.liveness import LivenessWatch
from radixserve.scheduler.metrics import SchedulerMetrics
from radixserve.scheduler.tracing import SchedulerTracer
from radixserve.scheduler.worker import AlreadyHere, EngineWorker, ShuttingDown, Submit, TokenUpdate

log = logging.getLogger(__name__)

SERVICE_NAME = "radixserve.v1.Scheduler"
# A Watch's interval_s: shorter ones are raised to the minimum (a pod is not a busy loop for a
# client); longer ones, and NaN or negative ones, are INVALID_ARGUMENT.
_MIN_WATCH_INTERVAL_S = 0.01
_MAX_WATCH_INTERVAL_S = 3600.0

# The worker's refusals as gRPC status codes (ValueError: a bad request).
_REFUSALS: dict[type[Exception], grpc.StatusCode] = {
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    AlreadyHere: grpc.StatusCode.ALREADY_EXISTS,
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
}


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where a pod publishes its block events and heartbeats (the Redis prefix index), and how often."""

    url: str
    key_prefix: str
    heartbeat_interval_s: float
    heartbeat_ttl_s: float


class SchedulerService(pb_grpc.SchedulerServicer):
    def __init__(
        self,
        engine: Engine,
        address: str,
        detokenizer: str,
        health: HealthServicer,
        load_interval_s: float = 0.2,
        model_name: str = "",
        block_size: int = DEFAULT_BLOCK_SIZE,
        tls: TLS | None = None,
        stall_timeout_s: float = 0.0,
        on_failure: Callable[[str], None] | None = None,
        publish_to: RedisTarget | None = None,
    ) -> None:
        """``health``: the server's health servicer (liveness.py sets its "liveness" service);
        ``on_failure``: the engine failed (EngineWorker's); ``publish_to``: also publish to Redis."""
        self.model_name = model_name
        self.block_size = block_size
        self.address = address
        self.load_interval_s = load_interval_s
        self.out = StreamSender(
            detokenizer,
            lambda ch: pb_grpc.DetokenizerStub(ch).PushTokens,
            name="scheduler",
            encode=self._token_batch,  # protobuf is built on the sender thread, not the engine's
            tls=tls,
        )
        self.metrics = SchedulerMetrics(model_name)
        tracer = SchedulerTracer(address, engine.config.schedule_policy) if telemetry.enabled() else None
        self.worker = EngineWorker(
            engine,
            address,
            self._emit,
            self.metrics,
            tracer,
            block_size=block_size,
            model_name=model_name,
            on_failure=on_failure,
        )
        self.liveness = LivenessWatch(self.worker, health, stall_timeout_s)  # adds "liveness"
        self.publisher = self._publisher(publish_to) if publish_to is not None else None
        self.metrics.collect_from(self)

    def _publisher(self, target: RedisTarget) -> RedisPublisher:
        from radixserve.common.prefix_index import RedisPrefixIndex

        return RedisPublisher(
            RedisPrefixIndex(target.url, target.key_prefix),
            self.address,
            self.worker.events.subscribe(EventSubscriber()),
            self.load_dict,
            target.heartbeat_interval_s,
            target.heartbeat_ttl_s,
            location=self.worker.scheduler.kv.cache.disk_location,
        )

    def start(self) -> None:
        self.worker.start()
        self.liveness.start()
        if self.publisher is not None:
            self.publisher.start()

    def stop_publishing(self) -> None:
        """Leave the Redis index (shutdown): gateways stop routing here within one sweep."""
        if self.publisher is not None:
            self.publisher.close()

    # ------------------------------------------------------------------------- handlers
    def Submit(self, request: pb.TokenizedRequest, context: grpc.ServicerContext) -> pb.SubmitReply:
        if not request.reply_to:  # else the detokenizer would retry a stream to "" for good
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "reply_to is empty: expected the gateway's address"
            )
        try:
            self.worker.submit(
                Submit(
                    rid=request.rid,
                    input_ids=list(request.input_ids),
                    sampling=sampling_from_proto(request.sampling),
                    reply_to=request.reply_to,
                    skip_special_tokens=request.sampling.skip_special_tokens,
                    trace_context=dict(request.trace_context) or None,
                    continuation=_continuation(request),
                )
            )
        except tuple(_REFUSALS) as e:
            code = next(c for kind, c in _REFUSALS.items() if isinstance(e, kind))
            context.abort(code, str(e))
        return pb.SubmitReply()

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        n = self.worker.abort(list(request.rids), request.reason or "aborted by the client")
        return pb.AbortReply(aborted=n)

    def Holds(self, request: pb.RequestIds, context: grpc.ServicerContext) -> pb.RequestIds:
        return pb.RequestIds(rids=self.worker.holds(list(request.rids)))

    def GetLoad(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.Load:
        return self.load()

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.PodUpdate]:
        interval = request.interval_s or self.load_interval_s
        if not 0 < interval <= _MAX_WATCH_INTERVAL_S:  # NaN, negative: a stream of updates without pause
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"interval_s={request.interval_s}: expected 0 (default) to {_MAX_WATCH_INTERVAL_S:g} s",
            )
        interval = max(interval, _MIN_WATCH_INTERVAL_S)
        events = self.worker.events
        sub = events.subscribe(EventSubscriber()) if request.kv_events else None
        self.worker.wake()  # the engine thread sends the snapshot at its next iteration
        stopped = self.worker.stopped
        try:
            while context.is_active() and not stopped.is_set():
                update = pb.PodUpdate(block_size=self.block_size, model_name=self.model_name)
                if sub is None:
                    stopped.wait(interval)
                else:
                    got = sub.take(interval)
                    if got is not None:
                        update.cleared = got.cleared
                        update.stored.extend(got.stored)
                        update.tiers.extend(got.tiers)
                        update.removed.extend(got.removed)
                update.load.CopyFrom(self.load())
                yield update
        finally:
            if sub is not None:
                events.unsubscribe(sub)

    def MatchPrefix(
        self, request: pb.MatchPrefixRequest, context: grpc.ServicerContext
    ) -> pb.MatchPrefixReply:
        return pb.MatchPrefixReply(cached_tokens=self.worker.match_prefix(list(request.input_ids)))

    # ------------------------------------------------------------------ worker <-> protobuf
    def _emit(self, updates: list[TokenUpdate], on_taken: Callable[[], None] | None) -> None:
        self.out.send(updates, on_taken=on_taken)

    def _token_batch(self, updates: list[TokenUpdate]) -> pb.TokenBatch:
        return pb.TokenBatch(reqs=[_to_proto(u) for u in updates], scheduler=self.address)

    def load(self) -> pb.Load:
        return pb.Load(**dataclasses.asdict(self.worker.load()))

    def load_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self.worker.load())

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

    # -------------------------------------------------------------------------- lifecycle
    def drain(self, timeout_s: float) -> int:
        return self.worker.drain(timeout_s)

    def close(self) -> None:
        self.worker.stop()
        try:
            self.out.close()  # flush the final updates to the detokenizer before the engine goes
        finally:
            self.worker.close()


def _continuation(request: pb.TokenizedRequest) -> Continuation | None:
    if not request.HasField("continuation"):
        return None
    c = request.continuation
    return Continuation(tuple(c.output_ids), c.text_chars)


def _to_proto(u: TokenUpdate) -> pb.RequestTokens:
    e = pb.RequestTokens(
        rid=u.rid, token_ids=u.token_ids, finish_reason=u.finish_reason, error=u.error, reply_to=u.reply_to
    )
    if u.options is not None:
        o, eo = u.options, e.options
        eo.stop.extend(o.stop)
        eo.skip_special_tokens = o.skip_special_tokens
        eo.prompt_tokens, eo.cached_tokens = o.prompt_tokens, u.cached_tokens
        eo.include_stop, eo.min_tokens = o.include_stop, o.min_tokens
        if o.trace_context:
            eo.trace_context.update(o.trace_context)
        if o.continuation is not None:
            eo.continuation.output_ids.extend(o.continuation.output_ids)
            eo.continuation.text_chars = o.continuation.text_chars
    if u.logprobs is not None:
        e.logprobs.CopyFrom(logprobs_to_proto(u.logprobs))
    if u.prompt_logprobs is not None:
        e.prompt_logprobs.CopyFrom(logprobs_to_proto(u.prompt_logprobs))
    return e


def serve(
    engine: Engine,
    address: str,
    detokenizer: str,
    advertise: str | None = None,
    workers: int = 16,
    model_name: str = "",
    block_size: int = DEFAULT_BLOCK_SIZE,
    tls: TLS | None = None,
    stall_timeout_s: float = 0.0,
    on_failure: Callable[[str], None] | None = None,
    publish_to: RedisTarget | None = None,
) -> tuple[grpc.Server, SchedulerService, HealthServicer]:
    """Start the engine thread and the gRPC server on ``address``; others reach it at ``advertise``.
    ``tls``: the port and the stream to the detokenizer use it (rpc.listen, rpc.channel).

    Health: "" and the Scheduler service are readiness (NOT_SERVING once it drains or fails);
    "liveness" is NOT_SERVING while the engine has had work and not stepped for ``stall_timeout_s``
    (liveness.py; 0: never)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS)
    health = add_health(server, [SERVICE_NAME])
    service = SchedulerService(
        engine,
        advertise or address,
        detokenizer,
        health,
        model_name=model_name,
        block_size=block_size,
        tls=tls,
        stall_timeout_s=stall_timeout_s,
        on_failure=on_failure,
        publish_to=publish_to,
    )
    pb_grpc.add_SchedulerServicer_to_server(service, server)
    listen(server, address, tls)
    service.start()
    server.start()
    return server, service, health


def fail(
    server: grpc.Server, service: SchedulerService, health: HealthServicer, reason: str, wait_s: float
) -> None:
    """The engine cannot go on (it failed, or a tensor-parallel rank died): not serving, let the
    engine thread end its requests with the error (a collective waiting on a dead rank fails, at the
    latest after the group's timeout: ``wait_s``), send those errors, stop. The caller exits non-zero."""
    set_not_serving(health, [SERVICE_NAME])
    service.worker.stop_admitting()  # gateways send new requests elsewhere
    service.stop_publishing()
    if not service.worker.join(wait_s):
        log.error("the engine thread did not end within %.0f s; exiting without it", wait_s)
    service.worker.stopped.set()
    try:
        service.out.close()  # the requests' errors to the detokenizer
    finally:
        server.stop(grace=1).wait()
        followers = service.worker.engine.followers
        if followers is not None:
            followers.close(1)


def shutdown(
    server: grpc.Server, service: SchedulerService, health: HealthServicer, drain_timeout_s: float
) -> None:
    """SIGTERM: not serving (probes fail, gateways stop routing here), drain, stop."""
    set_not_serving(health, [SERVICE_NAME])
    aborted = service.drain(drain_timeout_s)
    if aborted:
        log.warning("aborted %d unfinished requests at shutdown", aborted)
    service.close()
    server.stop(grace=1).wait()
