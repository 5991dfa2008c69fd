"""An OTLP/gRPC trace receiver for tests: the services export their spans to it over loopback."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector: keeps every span with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next(
                    a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                )
                for ss in rs.scope_spans:
                    self.spans += [(service, s) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id == trace_id]


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = (
            list(x.string_value for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)
        )
    return out


def start_receiver() -> tuple[Receiver, grpc.Server, dict[str, str]]:
    """A running receiver, its server (stop it), and the environment that points services at it."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    return receiver, server, env
