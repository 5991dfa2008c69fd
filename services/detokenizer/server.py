"""The detokenizer service: TokenBatch streams in from schedulers, TextBatch streams out to gateways.

One TextBatch per incoming TokenBatch per gateway named in its entries' ``reply_to``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from radixserve.common import telemetry
from radixserve.common.health import add_health
from radixserve.common.rpc import SERVER_OPTIONS, listen, pb, pb_grpc
from radixserve.common.stream_sender import StreamSender
from radixserve.common.tls import TLS
from radixserve.detokenizer.incremental import IncrementalDetokenizer, RequestTokens, TextDelta, Tokenizer

log = logging.getLogger(__name__)


def updates_from_proto(batch: pb.TokenBatch) -> list[RequestTokens]:
    out = []
    for e in batch.reqs:
        u = RequestTokens(e.rid, e.reply_to, list(e.token_ids), e.finish_reason, e.error)
        if e.HasField("options"):
            o = e.options
            u.stop, u.skip_special_tokens = tuple(o.stop), o.skip_special_tokens
            u.prompt_tokens, u.cached_tokens = o.prompt_tokens, o.cached_tokens
            u.include_stop, u.min_tokens = o.include_stop, o.min_tokens
            if o.HasField("continuation"):
                u.continued_ids = list(o.continuation.output_ids)
                u.continued_chars = o.continuation.text_chars
        if e.HasField("logprobs"):
            u.logprobs = e.logprobs
        if e.HasField("prompt_logprobs"):
            u.prompt_logprobs = e.prompt_logprobs
        out.append(u)
    return out


def text_to_proto(d: TextDelta) -> pb.RequestText:
    msg = pb.RequestText(
        rid=d.rid,
        text=d.text,
        token_ids=d.token_ids,
        finish_reason=d.finish_reason,
        error=d.error,
        prompt_tokens=d.prompt_tokens,
        completion_tokens=d.completion_tokens,
        cached_tokens=d.cached_tokens,
        matched_stop=d.matched_stop,
        ended_early=d.ended_early,
        lost_start=d.lost_start,
    )
    if d.logprobs is not None:
        msg.logprobs.CopyFrom(d.logprobs)
    if d.prompt_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(d.prompt_logprobs)
    return msg


class DetokenizerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.batches = Counter("radixserve_detokenizer_batches", "TokenBatches received", registry=r)
        self.tokens = Counter("radixserve_detokenizer_tokens", "Tokens detokenized", registry=r)
        self.finished = Counter(
            "radixserve_detokenizer_requests",
            "Requests ended, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.stop_hits = Counter("radixserve_stop_string_hits", "Requests ended by a stop string", registry=r)
        self.batch_seconds = Histogram(
            "radixserve_detokenize_batch_seconds",
            "Time to detokenize one batch",
            registry=r,
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
        )


class DetokenizerService(pb_grpc.DetokenizerServicer):
    def __init__(self, tokenizer: Tokenizer, tls: TLS | None = None) -> None:
        self._tls = tls  # of the Deliver streams to the gateways
        self.detok = IncrementalDetokenizer(tokenizer)
        self._lock = threading.Lock()  # one stream per scheduler, one detokenizer state
        self._senders: dict[str, StreamSender] = {}
        self.metrics = DetokenizerMetrics()
        self.tracing = telemetry.enabled()
        self._traced: dict[str, tuple[dict[str, str], float]] = {}  # rid -> (trace headers, first seen)

    def PushTokens(
        self, request_iterator: Iterator[pb.TokenBatch], context: grpc.ServicerContext
    ) -> pb.PushReply:
        for batch in request_iterator:
            self.handle(batch)
        return pb.PushReply()

    def handle(self, batch: pb.TokenBatch) -> None:
        t0 = time.perf_counter()
        updates = updates_from_proto(batch)
        if self.tracing:
            now = time.monotonic()
            for e in batch.reqs:
                if e.HasField("options") and e.options.trace_context:
                    self._traced[e.rid] = (dict(e.options.trace_context), now)
        with self._lock:
            deltas = self.detok.process(updates)
            by_gateway: dict[str, list[pb.RequestText]] = defaultdict(list)
            for d in deltas:
                by_gateway[d.reply_to].append(text_to_proto(d))
            for gateway, reqs in by_gateway.items():
                self._sender(gateway).send(pb.TextBatch(reqs=reqs))
        m = self.metrics
        m.batches.inc()
        m.tokens.inc(sum(len(u.token_ids) for u in updates))
        for d in deltas:
            if d.finish_reason:
                m.finished.labels(d.finish_reason).inc()
                if d.matched_stop:
                    m.stop_hits.inc()
                if self._traced:
                    self._trace(d)
        m.batch_seconds.observe(time.perf_counter() - t0)

    def _trace(self, d: TextDelta) -> None:
        got = self._traced.pop(d.rid, None)
        if got is not None:
            carrier, first_seen = got
            telemetry.span_between(
                "detokenize",
                telemetry.extract(carrier),
                first_seen,
                time.monotonic(),
                {
                    "radixserve.rid": d.rid,  # the gateway's request id, with the choice's index
                    "gen_ai.usage.output_tokens": d.completion_tokens,
                    "gen_ai.response.finish_reasons": [d.finish_reason],
                    "radixserve.matched_stop": d.matched_stop,
                },
            )

    def _sender(self, gateway: str) -> StreamSender:
        s = self._senders.get(gateway)
        if s is None:
            s = StreamSender(
                gateway, lambda ch: pb_grpc.GatewayStub(ch).Deliver, name="detokenizer", tls=self._tls
            )
            self._senders[gateway] = s
        return s

    def close(self) -> None:
        for s in self._senders.values():
            s.close()


def serve(
    model: str, address: str, workers: int = 16, tls: TLS | None = None
) -> tuple[grpc.Server, DetokenizerService]:
    """``tls``: the port and the Deliver streams to the gateways use it (rpc.listen, rpc.channel)."""
    from transformers import AutoTokenizer

    service = DetokenizerService(AutoTokenizer.from_pretrained(model), tls)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS)
    pb_grpc.add_DetokenizerServicer_to_server(service, server)
    add_health(server, ["radixserve.v1.Detokenizer"])
    listen(server, address, tls)
    server.start()
    return server, service
