"""`radixserve serve`'s processes on loopback for the integration, fault and client tests: start a
cluster, stream a completion from it; the demo model they serve and the in-process reference engine
(fixtures, imported by those folders' conftests)."""

from __future__ import annotations

import time

import pytest

from radixserve.launcher import Cluster, build_cluster, counter_by, free_port

MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="session")
def model_dir(demo_model):
    return demo_model("llama")


def start_cluster(
    model_dir,
    schedulers: int,
    scheduler_args: list[str] | None = None,
    router: str = "round-robin",
    prefix_index: str = "memory",
    gateway_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    discover: bool = False,
    detokenizers: int = 1,
) -> Cluster:
    """``discover``: the gateway finds the schedulers by their heartbeats (``--schedulers discover``;
    ``prefix_index`` must be a Redis URL) instead of being given their addresses."""
    found = ["--schedulers", "discover"] if discover else []  # after the launcher's list: it wins
    cluster = build_cluster(
        model_dir,
        MODEL_NAME,
        port=free_port(),
        schedulers=schedulers,
        scheduler_args=scheduler_args or [],
        gateway_args=["--router", router, *found, *(gateway_args or [])],
        torch_threads=1,
        prefix_index=prefix_index,
        env=env,
        detokenizers=detokenizers,
    )
    cluster.start(timeout=180)
    return cluster


def greedy_body(prompt: str, max_tokens: int) -> dict:
    """A greedy completion's body: exactly ``max_tokens`` (EOS ignored), its usage in the stream."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(h, prompt: str, on_first, max_tokens: int) -> dict:
    """A greedy streamed completion of exactly ``max_tokens``, read by read_stream."""
    return await read_stream(h, greedy_body(prompt, max_tokens), on_first)


async def read_stream(h, body: dict, on_first=None, headers: dict | None = None) -> dict:
    """POSTs a streamed completion and reads its SSE: its text, finish reason, error message (None
    if none), usage (with stream_options.include_usage), when each choice chunk came (``chunks``) and
    when it ended (``time.monotonic()``). ``on_first`` (an asyncio.Event) is set at the first chunk."""
    import json
    import time

    out: dict = {"text": "", "finish": None, "error": None, "usage": None, "chunks": []}
    async with h.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                out["error"] = msg["error"]["message"]
                break
            out["usage"] = msg.get("usage") or out["usage"]
            for choice in msg["choices"]:
                out["chunks"].append(time.monotonic())
                out["text"] += choice["text"]
                out["finish"] = choice["finish_reason"] or out["finish"]
                if on_first is not None:
                    on_first.set()
    out["ended"] = time.monotonic()
    return out


async def read_grpc_stream(address: str, prompt: str, max_tokens: int, on_first=None) -> dict:
    """Streams a greedy ``Generate`` over the gateway's gRPC front (grpc.aio): the same fields as
    ``read_stream`` (text, finish, error, usage as ``{"completion_tokens": n}``, chunk times)."""
    import time

    import grpc

    from radixserve.common.rpc import pb, pb_grpc

    out: dict = {"text": "", "finish": None, "error": None, "usage": None, "chunks": []}
    sampling = pb.SamplingParams(max_new_tokens=max_tokens, temperature=0, ignore_eos=True)
    req = pb.GenerateRequest(model=MODEL_NAME, text=prompt, sampling=sampling, stream=True)
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            async for msg in pb_grpc.GatewayStub(ch).Generate(req, timeout=180):
                out["chunks"].append(time.monotonic())
                out["text"] += msg.text
                out["finish"] = msg.finish_reason or out["finish"]
                if msg.HasField("usage"):
                    out["usage"] = {"completion_tokens": msg.usage.completion_tokens}
                if on_first is not None:
                    on_first.set()
        except grpc.aio.AioRpcError as e:
            out["error"] = f"{e.code().name}: {e.details()}"
    out["ended"] = time.monotonic()
    return out


def failovers(cluster: Cluster) -> dict[str, float]:
    """The gateway's radixserve_stream_failovers counters, as ``cause/outcome``: count."""
    return counter_by(f"{cluster.url}/metrics", "radixserve_stream_failovers", "cause", "outcome")


def wait_not_admitting(scheduler, timeout: float = 30.0) -> None:
    """Until ``scheduler``'s readiness ("" in grpc.health.v1) is NOT_SERVING, or it is gone: it has
    taken its SIGTERM and admits nothing more (how soon depends on the machine's load)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    while True:
        with grpc.insecure_channel(scheduler.grpc_address) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5
                )
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:  # exited already
                    return
                raise
        if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            return
        assert time.monotonic() < deadline, f"scheduler {scheduler.grpc_address} still admits"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def engine(model_dir):
    """The in-process engine on the same weights: the reference for what the services return."""
    from radixserve import Engine

    with Engine(model_dir) as e:
        yield e
