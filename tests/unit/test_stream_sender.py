"""StreamSender.close: what is queued reaches a live peer before it returns; with nothing queued and
the peer gone (a shutdown where the gateway went first) it returns at once instead of waiting out
its timeout. Real gRPC over loopback."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from radixserve.common.rpc import listen, pb, pb_grpc
from radixserve.common.stream_sender import CLOSE_IDLE_S, StreamSender


class Receiver(pb_grpc.GatewayServicer):
    def __init__(self) -> None:
        self.got: list[str] = []
        self.ended = threading.Event()

    def Deliver(self, request_iterator, context):  # type: ignore[no-untyped-def]
        for batch in request_iterator:
            self.got += [r.rid for r in batch.reqs]
        self.ended.set()
        return pb.DeliverReply()


def test_close_delivers_what_is_queued_to_a_live_peer_and_ends_the_call() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    receiver = Receiver()
    pb_grpc.add_GatewayServicer_to_server(receiver, server)
    port = listen(server, "127.0.0.1:0")
    server.start()
    try:
        sender = StreamSender(f"127.0.0.1:{port}", lambda ch: pb_grpc.GatewayStub(ch).Deliver)
        for i in range(50):
            sender.send(pb.TextBatch(reqs=[pb.RequestText(rid=str(i))]))
        sender.close()
        assert receiver.ended.wait(5)
        assert receiver.got == [str(i) for i in range(50)]  # all of it, in order
    finally:
        server.stop(0)


def test_close_with_nothing_queued_does_not_wait_for_a_peer_that_is_gone() -> None:
    with socket_reserved() as port:  # nothing listens there
        sender = StreamSender(f"127.0.0.1:{port}", lambda ch: pb_grpc.GatewayStub(ch).Deliver)
        time.sleep(0.2)  # the sender thread is waiting for the peer to be ready
        t0 = time.monotonic()
        sender.close(timeout=5.0)
        assert time.monotonic() - t0 < CLOSE_IDLE_S + 1.0


class socket_reserved:
    """A loopback port nobody listens on (bound, not listening) while the block runs."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
