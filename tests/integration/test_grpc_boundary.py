"""Bad input at every gRPC port of the real services (gateway, scheduler, detokenizer): a message over
the receive limit, bytes that are not a protobuf, field values no client should send. Each gets a
clear status (RESOURCE_EXHAUSTED; INTERNAL, UNKNOWN from the asyncio gateway; INVALID_ARGUMENT; or a
harmless no-op) and the service goes on serving: a normal completion works after each, and nothing
is left holding KV.
The gateway's HTTP and Generate fuzzing is test_fuzz.py; the in-memory index's boundary (what a
Watch stream may carry) is tests/unit/test_index_boundary_memory.py."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest

from radixserve.common.health import is_serving
from radixserve.common.rpc import MAX_MESSAGE_BYTES, SERVER_OPTIONS, pb, pb_grpc
from radixserve.launcher import Cluster
from tests.helpers.cluster import MODEL_NAME, start_cluster

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def one(model_dir) -> Iterator[Cluster]:
    """A gateway, one scheduler and the detokenizer, all this module's to abuse."""
    c = start_cluster(model_dir, schedulers=1)
    yield c
    c.stop(drain_timeout=5)


def _address(c: Cluster, service: str) -> str:
    if service == "gateway":
        return c.grpc_address
    address = (c.schedulers[0] if service == "scheduler" else c.detokenizer).grpc_address
    assert address is not None
    return address


def _serves_normally(c: Cluster) -> None:
    """Every service is up, a completion goes through all of them, and no request is left on the pod."""
    for s in c.services:
        if s.grpc_address:
            assert is_serving(s.grpc_address, timeout=5), f"{s.name} is not serving"
        assert s.alive(), f"{s.name} exited"
    r = httpx.post(
        f"{c.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "ignore_eos": True},
        timeout=TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 10
    with grpc.insecure_channel(_address(c, "scheduler")) as ch:
        while True:
            load = pb_grpc.SchedulerStub(ch).GetLoad(pb.LoadRequest(), timeout=5)
            if load.waiting == 0 and load.running == 0 and load.kv_used_tokens == 0:
                return
            assert time.monotonic() < deadline, load
            time.sleep(0.1)


def test_every_server_uses_the_shared_receive_limit() -> None:
    """The three servers are built with SERVER_OPTIONS (grep-checked: a server built without them would
    take gRPC's 4 MiB default and refuse a large prompt's Submit)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "services"
    servers = {
        p.relative_to(root).as_posix(): p.read_text()
        for p in root.rglob("*.py")
        if "grpc.server(" in p.read_text() or "grpc.aio.server(" in p.read_text()
    }
    assert sorted(servers) == ["detokenizer/server.py", "scheduler/server.py", "tokenizer/__main__.py"]
    for name, text in servers.items():
        assert "options=SERVER_OPTIONS" in text, name
    assert ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES) in SERVER_OPTIONS


# ------------------------------------------------------------------------------ over the limit
def _over(n: int = MAX_MESSAGE_BYTES + 1) -> str:
    return "x" * n


OVER_LONG: dict[str, Callable[[grpc.Channel], Any]] = {
    "scheduler Submit": lambda ch: pb_grpc.SchedulerStub(ch).Submit(
        pb.TokenizedRequest(rid=_over(), input_ids=[1, 2]), timeout=TIMEOUT_S
    ),
    "scheduler MatchPrefix": lambda ch: pb_grpc.SchedulerStub(ch).MatchPrefix(
        pb.MatchPrefixRequest(
            input_ids=[2**31 - 1] * (MAX_MESSAGE_BYTES // 5 + 1)
        )  # 5 bytes each, timeout=TIMEOUT_S
    ),
    "detokenizer PushTokens": lambda ch: pb_grpc.DetokenizerStub(ch).PushTokens(
        iter([pb.TokenBatch(scheduler=_over())]), timeout=TIMEOUT_S
    ),
    "gateway Generate": lambda ch: list(
        pb_grpc.GatewayStub(ch).Generate(pb.GenerateRequest(text=_over()), timeout=TIMEOUT_S)
    ),
    "gateway Deliver": lambda ch: pb_grpc.GatewayStub(ch).Deliver(
        iter([pb.TextBatch(reqs=[pb.RequestText(rid="r", text=_over())])]), timeout=TIMEOUT_S
    ),
}


@pytest.mark.parametrize("call", sorted(OVER_LONG))
def test_a_message_over_the_limit_is_resource_exhausted_and_the_service_serves_on(
    one: Cluster, call: str
) -> None:
    with grpc.insecure_channel(_address(one, call.split()[0])) as ch, pytest.raises(grpc.RpcError) as e:
        OVER_LONG[call](ch)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.value.code(), e.value.details())
    assert "larger than max" in (e.value.details() or ""), e.value.details()
    _serves_normally(one)


def test_a_prompt_over_grpcs_default_4_mib_still_gets_through_to_the_scheduler(one: Cluster) -> None:
    """Under the limit, over gRPC's default: the scheduler reads it and refuses it for what it is."""
    with grpc.insecure_channel(_address(one, "scheduler")) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.SchedulerStub(ch).Submit(
            pb.TokenizedRequest(rid="big", input_ids=[1] * (2 << 20), reply_to="127.0.0.1:1"),
            timeout=TIMEOUT_S,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in (e.value.details() or "")


# ----------------------------------------------------------------------------- not a protobuf
NOT_PROTOBUF = b"\xff" * 16  # a varint longer than ten bytes: no protobuf parser takes it
METHODS = [  # (service, full method name, kind)
    ("scheduler", "/radixserve.v1.Scheduler/Submit", "unary_unary"),
    ("scheduler", "/radixserve.v1.Scheduler/Abort", "unary_unary"),
    ("scheduler", "/radixserve.v1.Scheduler/Holds", "unary_unary"),
    ("scheduler", "/radixserve.v1.Scheduler/MatchPrefix", "unary_unary"),
    ("scheduler", "/radixserve.v1.Scheduler/Watch", "unary_stream"),
    ("detokenizer", "/radixserve.v1.Detokenizer/PushTokens", "stream_unary"),
    ("gateway", "/radixserve.v1.Gateway/Generate", "unary_stream"),
    ("gateway", "/radixserve.v1.Gateway/Deliver", "stream_unary"),
]


@pytest.mark.parametrize(("service", "method", "kind"), METHODS, ids=[m[1].split("/")[-1] for m in METHODS])
def test_bytes_that_are_not_a_protobuf_get_an_error_status_and_the_service_serves_on(
    one: Cluster, service: str, method: str, kind: str
) -> None:
    with grpc.insecure_channel(_address(one, service)) as ch:
        rpc = getattr(ch, kind)(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            if kind == "unary_unary":
                rpc(NOT_PROTOBUF, timeout=TIMEOUT_S)
            elif kind == "unary_stream":
                list(rpc(NOT_PROTOBUF, timeout=TIMEOUT_S))
            else:
                rpc(iter([NOT_PROTOBUF]), timeout=TIMEOUT_S)
    code, details = e.value.code(), e.value.details() or ""
    if service == "gateway":  # grpc.aio's server says UNKNOWN, with the parser's words
        assert code == grpc.StatusCode.UNKNOWN and "Error parsing message" in details, (code, details)
    else:  # the threaded server's "Exception deserializing request!"
        assert code == grpc.StatusCode.INTERNAL and "deserializ" in details, (code, details)
    _serves_normally(one)


# -------------------------------------------------------------------------- values out of bounds
def _submit(ch: grpc.Channel, **kw: Any) -> grpc.RpcError:
    sampling = kw.pop("sampling", pb.SamplingParams(max_new_tokens=2))
    req = pb.TokenizedRequest(
        rid=kw.pop("rid", "bad-values"), sampling=sampling, reply_to=kw.pop("reply_to", "127.0.0.1:1"), **kw
    )
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.SchedulerStub(ch).Submit(req, timeout=TIMEOUT_S)
    return e.value


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"rid": "", "input_ids": [1, 2]}, "rid is empty"),
        ({"input_ids": [1, 2], "reply_to": ""}, "reply_to is empty"),
        ({"input_ids": [1, -5, 2]}, "input_ids must be in"),
        ({"input_ids": [1, 2**31 - 1]}, "input_ids must be in"),
        ({"input_ids": []}, "the prompt is empty"),
        ({"input_ids": [1], "sampling": pb.SamplingParams(max_new_tokens=2**31 - 1)}, "max_new_tokens"),
        ({"input_ids": [1], "sampling": pb.SamplingParams(max_new_tokens=-3)}, "max_new_tokens"),
        ({"input_ids": [1], "sampling": pb.SamplingParams(max_new_tokens=2, temperature=math.nan)}, ""),
        ({"input_ids": [1], "sampling": pb.SamplingParams(max_new_tokens=2, top_k=-(2**31))}, ""),
    ],
    ids=[
        "empty-rid",
        "no-reply-to",
        "negative-id",
        "id-past-vocab",
        "no-prompt",
        "huge-max",
        "negative-max",
        "nan",
        "top-k",
    ],
)
def test_a_submit_with_values_no_gateway_sends_is_invalid_argument(
    one: Cluster, fields: dict[str, Any], words: str
) -> None:
    with grpc.insecure_channel(_address(one, "scheduler")) as ch:
        err = _submit(ch, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert words in (err.details() or ""), err.details()
    _serves_normally(one)


def test_abort_holds_and_match_of_unknown_or_odd_ids_are_harmless_no_ops(one: Cluster) -> None:
    with grpc.insecure_channel(_address(one, "scheduler")) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        rids = ["never-submitted", "", "\x00", "x" * 10_000]
        assert stub.Abort(pb.AbortRequest(rids=rids, reason="r" * 10_000), timeout=TIMEOUT_S).aborted == 0
        assert stub.Abort(pb.AbortRequest(), timeout=TIMEOUT_S).aborted == 0
        assert list(stub.Holds(pb.RequestIds(rids=rids), timeout=TIMEOUT_S).rids) == []
        for ids in ([], [-1, -(2**31)], [2**31 - 1] * 100):
            reply = stub.MatchPrefix(pb.MatchPrefixRequest(input_ids=ids), timeout=TIMEOUT_S)
            assert reply.cached_tokens == 0
    _serves_normally(one)


@pytest.mark.parametrize("interval", [-1.0, math.nan, math.inf, 1e9])
def test_a_watch_interval_that_would_busy_loop_or_overflow_is_invalid_argument(
    one: Cluster, interval: float
) -> None:
    with grpc.insecure_channel(_address(one, "scheduler")) as ch:
        call = pb_grpc.SchedulerStub(ch).Watch(pb.WatchRequest(interval_s=interval), timeout=TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as e:
            next(call)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert "interval_s" in (e.value.details() or "")
    _serves_normally(one)


def test_a_tiny_watch_interval_is_raised_to_the_minimum_not_a_busy_loop(one: Cluster) -> None:
    with grpc.insecure_channel(_address(one, "scheduler")) as ch:
        call = pb_grpc.SchedulerStub(ch).Watch(pb.WatchRequest(interval_s=1e-9), timeout=TIMEOUT_S)
        t0, n = 0.0, 0
        for _ in call:
            n += 1
            if n == 1:  # from the first report: the connect's time is not the interval's
                t0 = time.monotonic()
            elif time.monotonic() - t0 > 0.5:
                break
        call.cancel()
    assert 5 <= n <= 100, n  # about one per 10 ms, not thousands


def test_token_batches_with_odd_values_never_break_the_detokenizer(one: Cluster) -> None:
    """What only a broken or hostile scheduler would push: ids out of the vocabulary, no rid, no
    reply_to, an end without a start. The stream may be refused; the detokenizer serves on."""
    batches = [
        pb.TokenBatch(
            reqs=[pb.RequestTokens(rid="odd-1", token_ids=[-1, 2**31 - 1], reply_to="127.0.0.1:1")]
        ),
        pb.TokenBatch(reqs=[pb.RequestTokens(rid="", token_ids=[1], reply_to="")]),
        pb.TokenBatch(reqs=[pb.RequestTokens(rid="odd-2", finish_reason="nonsense", reply_to="127.0.0.1:1")]),
        pb.TokenBatch(
            reqs=[
                pb.RequestTokens(
                    rid="odd-3",
                    token_ids=[1],
                    reply_to="127.0.0.1:1",
                    options=pb.DetokenizeOptions(
                        prompt_tokens=-5, cached_tokens=-(2**31), stop=["", "x" * 10_000]
                    ),
                )
            ]
        ),
    ]
    with grpc.insecure_channel(_address(one, "detokenizer")) as ch:
        stub = pb_grpc.DetokenizerStub(ch)
        for b in batches:
            try:
                stub.PushTokens(iter([b]), timeout=TIMEOUT_S)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), b)
    _serves_normally(one)


def test_deliver_of_unknown_requests_is_a_no_op(one: Cluster) -> None:
    with grpc.insecure_channel(one.grpc_address) as ch:
        batch = pb.TextBatch(
            reqs=[
                pb.RequestText(rid="never-sent", text="x", finish_reason="stop"),
                pb.RequestText(rid="", token_ids=[-1], completion_tokens=-3, lost_start=True),
            ]
        )
        pb_grpc.GatewayStub(ch).Deliver(iter([batch, batch]), timeout=TIMEOUT_S)
    _serves_normally(one)
