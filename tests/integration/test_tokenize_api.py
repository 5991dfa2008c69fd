"""/v1/tokenize, /v1/detokenize and /v1/models/{id} through the gateway's FastAPI app over HTTP
(httpx's ASGI transport): a real Gateway over the demo model's tokenizer, no scheduler (these
endpoints never reach one). Also the guard that every request body the HTTP API takes refuses an
unknown field by name."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from tokenizers.processors import TemplateProcessing

from radixserve.common.rpc import pb
from radixserve.common.service_config import GatewayConfig
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.openai_api.app import build_app
from radixserve.tokenizer.openai_api.chat_request import ChatCompletionRequest
from radixserve.tokenizer.openai_api.requests import CompletionRequest
from radixserve.tokenizer.openai_api.responses import ResponseRequest
from radixserve.tokenizer.openai_api.tokenize import DetokenizeRequest, TokenizeRequest
from tests.helpers.cluster import MODEL_NAME
from tests.helpers.gateway import CALL_TEXT, WEATHER, ScriptedSchedulers

TEXTS = ["def add(a, b):", "import os\nimport sys\n", "# héllo wörld ✓", "  two  spaces , and . ", ""]
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Add two numbers"},
]
BOS = "<|bos|>"

# A valid body per request model the HTTP API takes. test_every_request_body_refuses_an_unknown_field
# holds this to the app's routes: a new endpoint's body must be added here.
VALID_BODIES: dict[type, dict[str, Any]] = {
    CompletionRequest: {"model": MODEL_NAME, "prompt": "x"},
    ChatCompletionRequest: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]},
    TokenizeRequest: {"model": MODEL_NAME, "prompt": "x"},
    DetokenizeRequest: {"model": MODEL_NAME, "tokens": [1]},
    ResponseRequest: {"model": MODEL_NAME, "input": "x"},
}


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def make_gateway(model_dir) -> Callable[[str], Gateway]:
    def make(name: str = MODEL_NAME) -> Gateway:
        # A scheduler address is required, but the pool is never started: nothing is dialled.
        return Gateway(model_dir, name, GatewayConfig(schedulers=("127.0.0.1:1",)))

    return make


def make_app(gw: Gateway) -> FastAPI:
    return build_app(gw)  # build_app adds these routes (tokenize.add_routes)


@pytest.fixture(scope="module")
def gw(make_gateway) -> Gateway:
    return make_gateway()


@pytest.fixture(scope="module")
def app(gw) -> FastAPI:
    return make_app(gw)


@pytest.fixture(scope="module")
def bos_gw(make_gateway) -> Gateway:
    """A gateway whose tokenizer adds a BOS to plain text (the demo tokenizer adds none), so that
    add_special_tokens has something to switch."""
    g = make_gateway()
    bos = g.tokenizer.convert_tokens_to_ids(BOS)
    g.tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
    )
    assert g.encode("x")[0] == bos
    return g


def call(
    app: FastAPI, method: str, path: str, body: Any = None, content: bytes | None = None
) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as h:
            if content is not None:
                headers = {"content-type": "application/json"}
                return await h.request(method, path, content=content, headers=headers)
            return await h.request(method, path, json=body)

    return asyncio.run(go())


def tokenize(app: FastAPI, **body: Any) -> dict[str, Any]:
    r = call(app, "POST", "/v1/tokenize", {"model": MODEL_NAME, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert out["count"] == len(out["tokens"])
    return out


def detokenize(app: FastAPI, tokens: list[int]) -> str:
    r = call(app, "POST", "/v1/detokenize", {"model": MODEL_NAME, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"prompt"}
    prompt: str = r.json()["prompt"]
    return prompt


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["code"] == code
    assert err["message"]


# ------------------------------------------------------------------------------------ tokenize
def test_tokenize_then_detokenize_gives_the_text_back(app, gw):
    for text in TEXTS:
        out = tokenize(app, prompt=text)
        assert out == {"count": len(gw.encode(text)), "max_model_len": None, "tokens": gw.encode(text)}
        assert detokenize(app, out["tokens"]) == text


def test_chat_tokens_are_the_chat_templates(app, gw):
    template = gw.tokenizer.apply_chat_template
    out = tokenize(app, messages=MESSAGES)
    assert out["tokens"] == template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out["tokens"] == gw.text.encode_chat(MESSAGES)  # what /v1/chat/completions sends
    assert out["count"] == len(out["tokens"])
    # content as parts, as the chat endpoint takes it: the same ids
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    assert tokenize(app, messages=parts) == out

    without = tokenize(app, messages=MESSAGES, add_generation_prompt=False)
    assert without["tokens"] == template(
        MESSAGES, add_generation_prompt=False, tokenize=True, return_dict=False
    )
    assert len(without["tokens"]) < out["count"]
    assert out["tokens"][: without["count"]] == without["tokens"]


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture
def engine(gw, monkeypatch) -> ScriptedSchedulers:
    """The schedulers replaced by test_openai_fields' script: what the chat endpoint submits is seen."""
    e = ScriptedSchedulers()
    monkeypatch.setattr(gw, "submit", e.submit)
    return e


@pytest.mark.parametrize("messages", [TOOL_TURN, [{"role": "developer", "content": "Be brief."}, *TOOL_TURN]])
def test_tokenize_counts_what_the_chat_endpoint_sends(app, engine, messages):
    """Tool calls, tool results and the tools themselves are rendered as the chat endpoint renders
    them: tokenize's count is the chat completion's prompt_tokens, its ids what was submitted."""
    body = {"model": MODEL_NAME, "messages": messages, "tools": [WEATHER], "max_tokens": 2}
    r = call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = tokenize(app, messages=messages, tools=[WEATHER])
    assert out["count"] == r.json()["usage"]["prompt_tokens"]
    assert out["tokens"] == engine.sent[-1][0]
    assert CALL_TEXT.split("\n")[1] in detokenize(app, out["tokens"])  # the past call, as the model wrote it
    # without the generation prompt: the same conversation, the assistant's header left out
    without = tokenize(app, messages=messages, tools=[WEATHER], add_generation_prompt=False)
    assert out["tokens"][: without["count"]] == without["tokens"] and without["count"] < out["count"]


def test_developer_messages_are_rendered_as_system(app):
    system = tokenize(app, messages=[{"role": "system", "content": "Be brief."}, *MESSAGES[1:]])
    assert tokenize(app, messages=[{"role": "developer", "content": "Be brief."}, *MESSAGES[1:]]) == system


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([*MESSAGES, {"role": "tool", "content": "x"}], "messages.2.tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages.0.tool_calls"),
        ([{"role": "user", "content": "x", "tool_call_id": "call_1"}], "messages.0.tool_call_id"),
    ],
)
def test_tokenize_checks_messages_as_the_chat_endpoint_does(app, messages, param):
    for path in ("/v1/tokenize", "/v1/chat/completions"):
        assert_error(call(app, "POST", path, {**M, "messages": messages}), 400, param)


def test_tokenize_checks_tools_as_the_chat_endpoint_does(app):
    body = {**M, "messages": MESSAGES, "tools": [WEATHER, WEATHER]}
    assert_error(call(app, "POST", "/v1/tokenize", body), 400, "tools")
    assert_error(call(app, "POST", "/v1/tokenize", {**M, "prompt": "x", "tools": [WEATHER]}), 400, "tools")


def test_add_special_tokens_is_honoured_and_on_by_default(bos_gw):
    app = make_app(bos_gw)
    bos = bos_gw.tokenizer.convert_tokens_to_ids(BOS)
    text = TEXTS[0]
    plain = bos_gw.tokenizer.encode(text, add_special_tokens=False)
    assert tokenize(app, prompt=text)["tokens"] == [bos, *plain] == bos_gw.encode(text)  # as completions
    assert tokenize(app, prompt=text, add_special_tokens=True)["tokens"] == [bos, *plain]
    off = tokenize(app, prompt=text, add_special_tokens=False)
    assert off == {"count": len(plain), "max_model_len": None, "tokens": plain}
    # detokenize keeps special tokens: the ids are the client's, nothing of them is hidden
    assert detokenize(app, [bos, *plain]) == BOS + text


def test_max_model_len_is_the_schedulers_context(make_gateway, monkeypatch):
    g = make_gateway()
    app = make_app(g)
    h = g.pool.handles[0]
    monkeypatch.setattr(h, "healthy", True)
    monkeypatch.setattr(h, "load", pb.Load(max_context_len=512))
    assert tokenize(app, prompt="x")["max_model_len"] == 512
    assert tokenize(app, messages=MESSAGES)["max_model_len"] == 512


# ---------------------------------------------------------------------------------- bad input
M = {"model": MODEL_NAME}
USER = [{"role": "user", "content": "hi"}]
NAMED = [{"role": "user", "content": "x", "name": 5}]  # OpenAI's ``name`` is text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/tokenize", {**M, "prompt": "x", "return_token_strs": True}, "return_token_strs"),
        ("/v1/tokenize", {**M, "prompt": 5}, "prompt"),
        ("/v1/tokenize", {**M, "prompt": ["a", "b"]}, "prompt"),
        ("/v1/tokenize", {**M, "prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/v1/tokenize", {**M, "messages": "hi"}, "messages"),
        ("/v1/tokenize", {**M, "messages": NAMED}, "messages.0.name"),
        ("/v1/tokenize", {**M, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ("/v1/tokenize", {**M, "messages": USER, "add_generation_prompt": 1}, "add_generation_prompt"),
        ("/v1/tokenize", {"prompt": "x"}, "model"),
        ("/v1/tokenize", {**M, "prompt": "x", "messages": USER}, "messages"),
        ("/v1/tokenize", {**M}, "prompt"),
        ("/v1/tokenize", {**M, "prompt": None, "messages": None}, "prompt"),
        ("/v1/tokenize", {**M, "prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/v1/tokenize", {**M, "messages": USER, "add_special_tokens": False}, "add_special_tokens"),
        ("/v1/tokenize", {**M, "messages": []}, "messages"),
        ("/v1/detokenize", {**M, "tokens": [1, 2048]}, "tokens"),
        ("/v1/detokenize", {**M, "tokens": [2**31]}, "tokens.0"),
        ("/v1/detokenize", {**M, "tokens": [1, -1]}, "tokens.1"),
        ("/v1/detokenize", {**M, "tokens": [1.0]}, "tokens.0"),
        ("/v1/detokenize", {**M, "tokens": ["1"]}, "tokens.0"),
        ("/v1/detokenize", {**M, "tokens": "1 2"}, "tokens"),
        ("/v1/detokenize", {**M}, "tokens"),
        ("/v1/detokenize", {**M, "tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(app, path, body, param):
    assert_error(call(app, "POST", path, body), 400, param)


def test_ids_beyond_the_vocabulary_are_refused_not_dropped(app, gw):
    vocab = len(gw.tokenizer)
    assert detokenize(app, [vocab - 1]) == gw.tokenizer.decode([vocab - 1])
    r = call(app, "POST", "/v1/detokenize", {**M, "tokens": [1, 2, vocab]})
    assert_error(r, 400, "tokens")
    assert f"tokens[2] = {vocab}" in r.json()["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(app):
    assert_error(call(app, "POST", "/v1/tokenize", content=b'{"model": '), 400, None)
    assert_error(call(app, "POST", "/v1/detokenize", content=b"[1, 2]"), 400, "body")


@pytest.mark.parametrize(
    "path, extra", [("/v1/tokenize", {"prompt": "x"}), ("/v1/detokenize", {"tokens": [1]})]
)
def test_another_model_is_a_404_model_not_found(app, path, extra):
    r = call(app, "POST", path, {"model": "gpt-4", **extra})
    assert_error(r, 404, "model", "model_not_found")
    assert "gpt-4" in r.json()["error"]["message"]


# --------------------------------------------------------------------------------- /v1/models/id
def test_model_by_id_is_the_entry_of_the_list(app):
    listed = call(app, "GET", "/v1/models").json()["data"]
    r = call(app, "GET", f"/v1/models/{MODEL_NAME}")
    assert r.status_code == 200
    assert [r.json()] == listed


@pytest.mark.parametrize("model_id", ["nope", "org/nope", MODEL_NAME + "/x", MODEL_NAME.upper()])
def test_an_unknown_model_id_is_a_404_model_not_found(app, gw, model_id):
    r = call(app, "GET", f"/v1/models/{model_id}")
    assert_error(r, 404, "model", "model_not_found")
    assert repr(model_id) in r.json()["error"]["message"]
    # counted under the route, not under each made-up path
    labels = {"endpoint": "/v1/models/{model_id}", "status": "404"}
    assert gw.metrics.registry.get_sample_value("radixserve_requests_total", labels)


def test_a_model_id_with_a_slash_is_found(make_gateway):
    g = make_gateway("org/tiny-llama")
    app = make_app(g)
    r = call(app, "GET", "/v1/models/org/tiny-llama")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "org/tiny-llama"
    assert [r.json()] == call(app, "GET", "/v1/models").json()["data"]


# ------------------------------------------------------------------------- every request body
def body_models(app: FastAPI) -> dict[type, APIRoute]:
    """Each pydantic model a route of ``app`` takes as its body, with that route."""
    out: dict[type, APIRoute] = {}
    for route in app.routes:
        if isinstance(route, APIRoute):
            for field in route.dependant.body_params:
                model = field.field_info.annotation
                assert isinstance(model, type), f"{route.path}: body {model!r} is not one model"
                assert model not in out, f"{model.__name__} is the body of two routes"
                out[model] = route
    return out


def test_every_request_body_refuses_an_unknown_field(app):
    routes = body_models(app)
    # A route with a body this test does not know fails here: add a valid body to VALID_BODIES.
    assert set(routes) == set(VALID_BODIES), {m.__name__ for m in set(routes) ^ set(VALID_BODIES)}
    for model, body in VALID_BODIES.items():
        route = routes[model]
        (method,) = route.methods
        model.model_validate(body)  # valid as it is: the field below is the only fault
        r = call(app, method, route.path, {**body, "frobnicate": 1})
        assert r.status_code == 400, (route.path, r.text)
        err = r.json()["error"]
        assert (err["param"], err["type"]) == ("frobnicate", "invalid_request_error"), (route.path, err)
        assert "frobnicate" in err["message"]
