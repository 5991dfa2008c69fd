"""Throughput with OpenTelemetry tracing on (sample ratio 1.0, every request traced, spans exported
over OTLP/gRPC to a receiver in this process) vs off, same served workload, in one run.

Closed loop: ``--concurrency`` clients each send requests back to back (prompts of random token
ids, greedy, ignore_eos, fixed output length) against one `radixserve serve`-style cluster per
setting. Settings alternate (off, on, off, on, ...) so drift on a shared machine hits both.

    python benchmarks/tracing_overhead.py [--rounds 2] [--seconds 40] [--concurrency 16] [--out DIR]

Writes OUT/tracing_overhead.json. Target (observability issue): tracing costs at most 3% throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info

from radixserve.common.demo_model import make_demo_model
from radixserve.launcher import build_cluster, free_port


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


async def _load(url: str, seconds: float, concurrency: int, out_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    done_tokens = 0
    requests = 0
    stop = time.monotonic() + seconds

    async def client(h: httpx.AsyncClient) -> None:
        nonlocal done_tokens, requests
        while time.monotonic() < stop:
            ids = [rng.randrange(10, 2000) for _ in range(rng.randrange(64, 256))]
            r = await h.post(
                "/v1/completions",
                json={
                    "model": "bench",
                    "prompt": ids,
                    "max_tokens": out_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            done_tokens += r.json()["usage"]["completion_tokens"]
            requests += 1

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=300) as h:
        await asyncio.gather(*[client(h) for _ in range(concurrency)])
    wall = time.monotonic() - t0
    return {
        "output_tokens": done_tokens,
        "requests": requests,
        "wall_s": wall,
        "output_tok_s": done_tokens / wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="HF model folder (default: the small demo model in a temp dir)")
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    p.add_argument("--seconds", type=float, default=40.0, help="load per setting and round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)

    tmp = tempfile.TemporaryDirectory()
    model = args.model or make_demo_model(Path(tmp.name) / "model", arch="llama", size="small")
    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    otlp_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    settings = {
        "off": {},
        "on": {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "1.0",
        },
    }
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for rnd in range(args.rounds):
        for name in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
            cluster = build_cluster(
                model,
                "bench",
                port=free_port(),
                schedulers=1,
                torch_threads=1,
                scheduler_args=["--page-size", "16", "--max-running-requests", "64"],
                env=settings[name],
            )
            cluster.start()
            try:
                spans_before = receiver.spans
                res = asyncio.run(_load(cluster.url, args.seconds, args.concurrency, args.output_tokens, rnd))
                time.sleep(1.0)  # the last batch of spans
                res["spans_received"] = receiver.spans - spans_before
            finally:
                cluster.stop(drain_timeout=2)
            runs[name].append(res)
            print(
                f"round {rnd} tracing {name:3}: {res['output_tok_s']:.1f} tok/s, {res['requests']} requests, "
                f"{res['spans_received']} spans",
                flush=True,
            )
    server.stop(0)
    off = statistics.mean(r["output_tok_s"] for r in runs["off"])
    on = statistics.mean(r["output_tok_s"] for r in runs["on"])
    cost = 1 - on / off
    spans_per_request = sum(r["spans_received"] for r in runs["on"]) / max(
        1, sum(r["requests"] for r in runs["on"])
    )
    report = {
        "benchmark": "served throughput with tracing on (ratio 1.0, OTLP export) vs off, closed loop",
        "config": vars(args) | {"model": str(model), "out": str(args.out)},
        "machine": machine_info(),
        "runs": runs,
        "output_tok_s": {"off": off, "on": on},
        "throughput_cost": cost,
        "spans_per_request": spans_per_request,
        "target": "cost <= 3%",
        "pass": cost <= 0.03,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tracing_overhead.json").write_text(json.dumps(report, indent=1, default=str))
    print(
        f"off {off:.1f} tok/s, on {on:.1f} tok/s: tracing costs {100 * cost:.1f}% "
        f"({spans_per_request:.1f} spans per request) -> {'PASS' if report['pass'] else 'FAIL'} (<= 3%)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
