"""The gateway's HTTP app in-process over a real Gateway on the demo model's tokenizer, with the
schedulers replaced by a script: ``ScriptedSchedulers.submit`` (patched over ``Gateway.submit``)
records the SamplingParams each request maps to and answers with hand-made deliveries
(pb.RequestText, logprobs included), so response bodies are checked without an engine. Requests go
through httpx's ASGI transport. The fixtures (``gw``, ``app``, ``engine``) reach tests/unit through
its conftest.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from radixserve.common.rpc import pb
from radixserve.common.sampling import SamplingParams
from radixserve.common.service_config import GatewayConfig
from radixserve.tokenizer.gateway import Gateway, SchedulerRequest
from radixserve.tokenizer.openai_api.app import build_app

MODEL = "tiny-llama"
USER = [{"role": "user", "content": "hello"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

Script = Callable[[int, list[int], SamplingParams], list[pb.RequestText]]


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def gw(demo_model) -> Gateway:
    no_pool = GatewayConfig(schedulers=("127.0.0.1:1",))  # the pool never starts
    return Gateway(demo_model("llama"), MODEL, no_pool)


@pytest.fixture(scope="module")
def app(gw) -> FastAPI:
    return build_app(gw)


class ScriptedSchedulers:
    """Stands in for the schedulers: records what each choice was sent, answers with ``script``."""

    def __init__(self) -> None:
        self.sent: list[tuple[list[int], SamplingParams]] = []
        self.script: Script = lambda k, ids, sp: [text("ok", [7], "stop")]

    async def submit(
        self, rid, input_ids, sp, n, skip, trace, queue, prompt_index=0
    ) -> list[SchedulerRequest]:
        sp.validate()
        choices = []
        for i in range(n):
            k = prompt_index * n + i
            self.sent.append((list(input_ids), sp))
            choices.append(
                SchedulerRequest(
                    f"{rid}-{k}", k, None, queue, len(input_ids), prompt_index, pb.TokenizedRequest(), trace
                )  # type: ignore[arg-type]
            )
            for t in self.script(k, list(input_ids), sp):
                queue.put_nowait((k, t))
        return choices


@pytest.fixture
def engine(gw, monkeypatch) -> ScriptedSchedulers:
    e = ScriptedSchedulers()
    monkeypatch.setattr(gw, "submit", e.submit)
    return e


def text(
    s: str,
    ids: list[int],
    finish: str = "",
    lp: pb.Logprobs | None = None,
    prompt: pb.Logprobs | None = None,
    done: int | None = None,
) -> pb.RequestText:
    """One delivery; ``done``: the choice's tokens so far (the detokenizer's count; default: these)."""
    count = len(ids) if done is None else done
    t = pb.RequestText(text=s, token_ids=ids, finish_reason=finish, completion_tokens=count)
    if lp is not None:
        t.logprobs.CopyFrom(lp)
    if prompt is not None:
        t.prompt_logprobs.CopyFrom(prompt)
    return t


def logprobs(values: list[float], tops: list[list[tuple[int, float]]] | None = None) -> pb.Logprobs:
    lp = pb.Logprobs(logprob=values)
    for top in tops or []:
        lp.top.add(token_ids=[t for t, _ in top], logprobs=[v for _, v in top])
    return lp


def post(app: FastAPI, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as h:
            # ASCII JSON: a lone surrogate goes as its \ud800 escape, as a hand-built body would
            headers = {"content-type": "application/json"}
            return await h.post(path, content=json.dumps(body), headers=headers)

    return asyncio.run(go())


def strict_json(raw: str) -> Any:
    """JSON as a strict parser reads it: NaN / Infinity are not JSON."""

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in a response body")

    return json.loads(raw, parse_constant=refuse)


def complete(app: FastAPI, **body: Any) -> httpx.Response:
    return post(app, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2, **body})


def chat(app: FastAPI, **body: Any) -> httpx.Response:
    return post(app, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 2, **body})


def events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [strict_json(x) for x in lines[:-1]]


def refused(r: httpx.Response, param: str, mentions: str = "") -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert mentions in err["message"], err


def sent(engine: ScriptedSchedulers) -> SamplingParams:
    return engine.sent[-1][1]
