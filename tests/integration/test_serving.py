"""End to end through real processes: the openai SDK and httpx over HTTP, gRPC Generate, against
the in-process Engine on the same weights."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest

from radixserve import SamplingParams
from radixserve.common.rpc import pb, pb_grpc
from tests.helpers.cluster import MODEL_NAME

PROMPTS = [
    "def add(a, b):",
    "import os\nimport sys\n",
    "class Foo:\n    def __init__(self",
    "# héllo wörld ✓",
]


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


def greedy(engine, prompt, n: int = 24) -> dict:
    return engine.generate(prompt=prompt, sampling_params=SamplingParams(max_new_tokens=n, temperature=0))


def loads(cluster) -> list:
    out = []
    for s in cluster.schedulers:
        with grpc.insecure_channel(s.grpc_address) as ch:
            out.append(pb_grpc.SchedulerStub(ch).GetLoad(pb.LoadRequest(), timeout=5))
    return out


def wait_idle(cluster, timeout: float = 20.0) -> list:
    """Every scheduler with nothing waiting or running and no KV held by requests."""
    deadline = time.monotonic() + timeout
    while True:
        ls = loads(cluster)
        if all(lo.waiting == 0 and lo.running == 0 and lo.kv_used_tokens == 0 for lo in ls):
            return ls
        if time.monotonic() > deadline:
            raise AssertionError(f"schedulers not idle after {timeout} s: {ls}")
        time.sleep(0.1)


# ------------------------------------------------------------------------------ completions
@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_text_equals_engine(cluster, engine, stream):
    c = client(cluster)
    for prompt in PROMPTS:
        ref = greedy(engine, prompt)
        if stream:
            chunks = list(
                c.completions.create(
                    model=MODEL_NAME,
                    prompt=prompt,
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            usage = chunks[-1].usage
        else:
            r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
            text, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert text == ref["text"]
        assert reason == ref["finish_reason"]
        assert usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        assert usage.completion_tokens == ref["meta_info"]["completion_tokens"]


def test_batch_prompts_and_n_choices_come_back_in_openai_order(cluster, engine):
    r = client(cluster).completions.create(
        model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=8, temperature=0, n=2
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for i, ch in enumerate(r.choices):
        assert ch.text == greedy(engine, PROMPTS[i // 2], 8)["text"]
    assert r.usage.completion_tokens == 32


@pytest.mark.parametrize("stream", [False, True])
def test_chat_uses_the_models_template_and_equals_engine(cluster, engine, stream):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Add two numbers"},
    ]
    ids = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    ref = engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=20, temperature=0))
    c = client(cluster)
    if stream:
        chunks = list(
            c.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_completion_tokens=20, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    else:
        r = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
        assert r.choices[0].message.role == "assistant"
        text = r.choices[0].message.content
        assert r.usage.prompt_tokens == len(ids)
    assert text == ref["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text_and_ends_the_request(cluster, engine, stream):
    full = greedy(engine, PROMPTS[0], 32)["text"]
    stop = full[10:13]
    assert stop.strip(), full
    c = client(cluster)
    kwargs = dict(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=[stop, "never-seen"]
    )
    if stream:
        chunks = list(c.completions.create(stream=True, **kwargs))
        text = "".join(ch.choices[0].text for ch in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = c.completions.create(**kwargs)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert text == full[: full.find(stop)]
    assert reason == "stop"
    wait_idle(cluster)  # the scheduler was told to stop generating


def test_max_tokens_bounds_the_output(cluster):
    r = client(cluster).completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=5,
        temperature=0.8,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_repeated_prompt_reports_cached_tokens(cluster):
    prompt = " ".join(f"word{i}" for i in range(60))
    c = client(cluster)
    cached = []
    for _ in range(3):  # round-robin over 2 schedulers: the third lands where the first ran
        r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0
    assert cached[2] == r.usage.prompt_tokens - 1  # all but the last token (it must be computed)


def test_seeded_sampling_is_reproducible(cluster):
    c = client(cluster)
    outs = {
        c.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=7)
        .choices[0]
        .text
        for _ in range(3)
    }
    assert len(outs) == 1


# ------------------------------------------------------------------------------------ gRPC
@pytest.mark.parametrize("stream", [False, True])
def test_grpc_generate_equals_engine(cluster, engine, stream):
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        stub = pb_grpc.GatewayStub(ch)
        for prompt in PROMPTS[:2]:
            ref = greedy(engine, prompt, 16)
            req = pb.GenerateRequest(
                model=MODEL_NAME,
                text=prompt,
                stream=stream,
                sampling=pb.SamplingParams(max_new_tokens=16, temperature=0),
            )
            msgs = list(stub.Generate(req, timeout=60))
            assert (len(msgs) > 1) == stream
            assert "".join(m.text for m in msgs) == ref["text"]
            assert [t for m in msgs for t in m.token_ids] == ref["token_ids"]
            assert msgs[-1].finish_reason == ref["finish_reason"]
            assert msgs[-1].usage.completion_tokens == 16


def test_grpc_generate_errors_have_the_right_status(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        stub = pb_grpc.GatewayStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(model="nope", text="hi"), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.Generate(
                    pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=10**7)),
                    timeout=10,
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "context length" in e.value.details()


def test_services_answer_grpc_health_checks(cluster):
    from radixserve.common.health import is_serving

    for address in [cluster.grpc_address, cluster.detokenizer.grpc_address] + [
        s.grpc_address for s in cluster.schedulers
    ]:
        assert is_serving(address)


# ------------------------------------------------------------------------------- load, abort
def test_64_concurrent_streams_all_complete_with_correct_text(cluster, engine):
    prompts = [f"{PROMPTS[i % 4]} # {i}" for i in range(64)]
    refs = engine.generate(prompt=prompts, sampling_params=SamplingParams(max_new_tokens=24, temperature=0))

    async def one(c: openai.AsyncOpenAI, p: str) -> str:
        stream = await c.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=24, temperature=0, stream=True
        )
        return "".join([ch.choices[0].text async for ch in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    texts = asyncio.run(all_of_them())
    assert texts == [r["text"] for r in refs]
    wait_idle(cluster)


def test_clients_that_disconnect_get_their_requests_aborted(cluster):
    body = {"model": MODEL_NAME, "prompt": "x" * 50, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}

    async def go() -> None:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as h:

            async def stream_then_leave() -> None:
                async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            break  # first chunk seen: hang up

            async def wait_then_leave() -> None:
                with pytest.raises(httpx.ReadTimeout):
                    await h.post("/v1/completions", json=body, timeout=1.0)

            await asyncio.gather(
                *[stream_then_leave() for _ in range(6)], *[wait_then_leave() for _ in range(2)]
            )

    asyncio.run(go())
    wait_idle(cluster, timeout=10)  # far sooner than 1900 tokens x 8 requests would take


# ------------------------------------------------------------------------------- bad input
BAD = [
    (b"{not json", 400, None),
    (json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": "5"}), 400, "max_tokens"),
    (json.dumps({"model": MODEL_NAME, "prompt": 5}), 400, "prompt"),
    (json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}), 400, "max_tokens"),
    (json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10**9}), 400, "context length"),
    (json.dumps({"model": MODEL_NAME, "prompt": "hi", "temperature": -1}), 400, "temperature"),
    (json.dumps({"model": MODEL_NAME, "prompt": "hi", "n": 0}), 400, "n"),
    (json.dumps({"model": MODEL_NAME, "prompt": "word " * 3000}), 400, "context length"),
    (json.dumps({"model": MODEL_NAME, "prompt": [10**6]}), 400, "input_ids"),
    (json.dumps({"model": MODEL_NAME, "prompt": ""}), 400, "empty"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}), 404, "gpt-4"),
    (json.dumps({"prompt": "hi"}), 400, "model"),
]


@pytest.mark.parametrize("body,status,mentions", BAD)
def test_bad_completion_requests_get_a_clear_4xx_and_the_server_keeps_serving(
    cluster, body, status, mentions
):
    r = httpx.post(
        f"{cluster.url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if mentions:
        assert mentions in err["message"] or mentions == err.get("param"), err
    ok = client(cluster).completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize(
    "messages,mentions",
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "hi"}], "role"),
        ("hello", "messages"),
        ([{"role": "user", "content": 3}], "content"),
    ],
)
def test_bad_chat_requests_get_400(cluster, messages, mentions):
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages})
    assert r.status_code == 400, r.text
    assert mentions in json.dumps(r.json()["error"])


def test_openai_sdk_sees_typed_errors(cluster):
    c = client(cluster)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-3)


def test_models_health_and_metrics_endpoints(cluster):
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    health = httpx.get(f"{cluster.url}/health").json()
    assert health["status"] == "ok" and all(health["schedulers"].values())
    metrics = httpx.get(f"{cluster.url}/metrics").text
    assert "radixserve_requests_total" in metrics and "radixserve_time_to_first_token_seconds" in metrics
