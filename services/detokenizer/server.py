"""The detokenizer service: TokenBatch streams in from schedulers, TextBatch streams out to gateways.

One TextBatch per incoming TokenBatch per gateway named in its entries' ``reply_to``.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from concurrent import futures
from typing import Any

import grpc

from radixserve.common.rpc import SERVER_OPTIONS, StreamSender, add_health, pb, pb_grpc
from radixserve.detokenizer.incremental import IncrementalDetokenizer, TextDelta, TokenUpdate

log = logging.getLogger(__name__)


def updates_from_proto(batch: Any) -> list[TokenUpdate]:
    out = []
    for e in batch.reqs:
        u = TokenUpdate(e.rid, e.reply_to, list(e.token_ids), e.finish_reason, e.error)
        if e.HasField("options"):
            o = e.options
            u.stop, u.skip_special_tokens = tuple(o.stop), o.skip_special_tokens
            u.prompt_tokens, u.cached_tokens = o.prompt_tokens, o.cached_tokens
        out.append(u)
    return out


def text_to_proto(d: TextDelta) -> Any:
    return pb.RequestText(
        rid=d.rid,
        text=d.text,
        token_ids=d.token_ids,
        finish_reason=d.finish_reason,
        error=d.error,
        prompt_tokens=d.prompt_tokens,
        completion_tokens=d.completion_tokens,
        cached_tokens=d.cached_tokens,
        matched_stop=d.matched_stop,
    )


class DetokenizerService(pb_grpc.DetokenizerServicer):
    def __init__(self, tokenizer: Any) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self._lock = threading.Lock()  # one stream per scheduler, one detokenizer state
        self._senders: dict[str, StreamSender] = {}
        self.batches_in = 0

    def PushTokens(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        for batch in request_iterator:
            self.handle(batch)
        return pb.PushReply()

    def handle(self, batch: Any) -> None:
        updates = updates_from_proto(batch)
        with self._lock:
            self.batches_in += 1
            deltas = self.detok.process(updates)
            by_gateway: dict[str, list[Any]] = defaultdict(list)
            for d in deltas:
                by_gateway[d.reply_to].append(text_to_proto(d))
            for gateway, reqs in by_gateway.items():
                self._sender(gateway).send(pb.TextBatch(reqs=reqs))

    def _sender(self, gateway: str) -> StreamSender:
        s = self._senders.get(gateway)
        if s is None:
            s = StreamSender(gateway, lambda ch: pb_grpc.GatewayStub(ch).Deliver, name="detokenizer")
            self._senders[gateway] = s
        return s

    def close(self) -> None:
        for s in self._senders.values():
            s.close()


def serve(model: str, address: str, workers: int = 16) -> tuple[grpc.Server, DetokenizerService]:
    from transformers import AutoTokenizer

    service = DetokenizerService(AutoTokenizer.from_pretrained(model))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS)
    pb_grpc.add_DetokenizerServicer_to_server(service, server)
    add_health(server, ["radixserve.v1.Detokenizer"])
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, service
