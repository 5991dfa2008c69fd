"""The OpenAI fields real clients send, at the gateway: penalties, logit_bias, logprobs (and echo),
response_format and vLLM's guided_*, tools and tool_choice.

Through the gateway's FastAPI app in-process (httpx's ASGI transport) over a real Gateway on the demo
model's tokenizer, with the schedulers replaced by a script: ``Gateway.submit`` records the
SamplingParams each request maps to and answers with hand-made deliveries (pb.RequestText, logprobs
included), so the response bodies are checked without an engine. The pure pieces (logprobs bodies,
text offsets, token bytes) are checked directly too.
"""

from __future__ import annotations

import json
import math

import pytest

from radixserve.common.rpc import pb
from tests.helpers.gateway import (
    CALL_TEXT,
    USER,
    WEATHER,
    chat,
    complete,
    events,
    logprobs,
    refused,
    sent,
    text,
)


# ------------------------------------------------------------------------- penalties and bias
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.5),
        ("presence_penalty", "1"),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"5": "1"}),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"2048": 1}),  # the demo vocabulary's size: one past its last id
        ("logit_bias", [5, 1]),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_penalties_and_logit_bias_out_of_range_are_400s_naming_the_field(app, engine, path, field, value):
    make = complete if path == "/v1/completions" else chat
    r = make(app, **{field: value})
    refused(r, r.json()["error"]["param"])
    assert r.json()["error"]["param"].split(".")[0] == field  # a bad value's key may follow: logit_bias.5
    assert not engine.sent


def test_penalties_and_logit_bias_reach_the_sampling_params(app, engine):
    body = {"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2}
    r = complete(app, **body, logit_bias={"5": 50, "2047": -100})
    assert r.status_code == 200, r.text
    sp = sent(engine)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (1.5, -0.5, 1.2)
    assert sp.logit_bias == ((5, 50.0), (2047, -100.0))
    assert chat(app, **body).status_code == 200
    assert sent(engine).repetition_penalty == 1.2


# ---------------------------------------------------------------------------- logprobs fields
def test_completion_logprobs_and_echo_map_to_sampling_params(app, engine):
    assert complete(app, logprobs=3).status_code == 200
    assert (sent(engine).logprobs, sent(engine).prompt_logprobs) == (3, None)
    assert complete(app, logprobs=0, echo=True).status_code == 200
    assert (sent(engine).logprobs, sent(engine).prompt_logprobs) == (0, 0)
    assert complete(app, echo=True).status_code == 200  # echo alone: the text only, no scores
    assert (sent(engine).logprobs, sent(engine).prompt_logprobs) == (None, None)
    refused(complete(app, logprobs=21), "logprobs")
    refused(complete(app, logprobs=True), "logprobs")
    refused(complete(app, logprobs=-1), "logprobs")


def test_max_tokens_0_only_with_echo(app, engine):
    refused(complete(app, max_tokens=0), "max_tokens", "echo")
    refused(chat(app, max_tokens=0), "max_tokens")
    refused(chat(app, max_completion_tokens=0), "max_completion_tokens")
    engine.script = lambda k, ids, sp: [
        text("", [], "length", prompt=logprobs([math.nan] + [-1.0] * (len(ids) - 1)))
    ]
    r = complete(app, max_tokens=0, echo=True)
    assert r.status_code == 200, r.text
    assert (sent(engine).max_new_tokens, sent(engine).prompt_logprobs) == (0, 0)
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == ("hello", "length", None)


def test_chat_logprobs_and_top_logprobs(app, engine):
    assert chat(app, logprobs=True).status_code == 200
    assert sent(engine).logprobs == 0
    assert chat(app, logprobs=True, top_logprobs=5).status_code == 200
    assert sent(engine).logprobs == 5
    assert chat(app, logprobs=False).status_code == 200
    assert sent(engine).logprobs is None
    refused(chat(app, top_logprobs=2), "top_logprobs", "logprobs")
    refused(chat(app, logprobs=True, top_logprobs=21), "top_logprobs")
    refused(chat(app, logprobs=1), "logprobs")


@pytest.mark.parametrize(("field", "value"), [("best_of", 2), ("suffix", "x")])
def test_best_of_and_suffix_stay_unsupported(app, engine, field, value):
    r = complete(app, **{field: value})
    refused(r, field)
    assert r.json()["error"]["code"] == "unsupported_parameter"
    assert complete(app, best_of=1).status_code == 200


# -------------------------------------------------------------------------- structured output
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("make", [complete, chat])
def test_response_format_and_guided_fields_map_to_one_constraint(app, engine, make):
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            ("json_schema", json.dumps(SCHEMA)),
        ),
        ({"guided_json": SCHEMA}, ("json_schema", json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, ("json_schema", json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]{3}"}, ("regex", "[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
    ]
    for body, want in cases:
        r = make(app, **body)
        assert r.status_code == 200, (body, r.text)
        c = sent(engine).constraint
        assert ((c.kind, c.spec) if c else None) == want, body


RF = "response_format"
JSON_OBJECT = {"type": "json_object"}


def json_schema(**spec: object) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize(
    ("body", "param", "mentions"),
    [
        ({RF: {"type": "xml"}}, RF, ""),
        ({RF: {"type": "json_schema"}}, f"{RF}.json_schema", "required"),
        ({RF: json_schema(name="a b")}, f"{RF}.json_schema.name", ""),
        ({RF: {"type": "json_object", "schema": {}}}, f"{RF}.schema", "not supported"),
        ({RF: json_schema(name="a", schema=3)}, f"{RF}.json_schema.schema", ""),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        ({RF: JSON_OBJECT, "guided_regex": "a"}, "guided_regex", "at most one"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json", "object"),
        ({"guided_choice": []}, "guided_choice", ""),
        ({"guided_choice": [""]}, "guided_choice.0", ""),
        ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json", "nope"),
        ({RF: JSON_OBJECT, "ignore_eos": True}, "ignore_eos", "constraint"),
    ],
)
def test_bad_constraints_are_400s_naming_their_field(app, engine, body, param, mentions):
    refused(complete(app, **body), param, mentions)
    assert not engine.sent


# ------------------------------------------------------------------------------------- tools
def test_tools_are_rendered_and_required_tool_choice_constrains(app, gw, engine):
    r = chat(app, tools=[WEATHER])
    assert r.status_code == 200, r.text
    prompt = gw.tokenizer.decode(engine.sent[-1][0])
    assert "<tools>" in prompt and '"get_weather"' in prompt
    assert sent(engine).constraint is None  # auto: the model chooses
    assert chat(app, tools=[WEATHER], tool_choice="required").status_code == 200
    assert sent(engine).constraint.kind == "lark" and "get_weather" in sent(engine).constraint.spec
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(app, tools=[WEATHER], tool_choice=named, parallel_tool_calls=False).status_code == 200
    assert sent(engine).constraint.kind == "lark"
    assert chat(app, tools=[WEATHER], tool_choice="none").status_code == 200
    assert "<tools>" not in gw.tokenizer.decode(engine.sent[-1][0])  # none: the tools are left out
    assert sent(engine).constraint is None


def function(**fn: object) -> dict[str, object]:
    return {"type": "function", "function": fn}


TOOLS = [WEATHER]


@pytest.mark.parametrize(
    ("body", "param", "mentions"),
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", ""),
        ({"tools": [function(name="bad name")]}, "tools.0.function.name", ""),
        ({"tools": [function(name="f", parameters=[])]}, "tools.0.function.parameters", ""),
        ({"tools": [WEATHER, WEATHER]}, "tools", "already used"),
        ({"tools": []}, "tools", ""),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
        ({"tools": TOOLS, "tool_choice": function(name="other")}, "tool_choice", "other"),
        ({"tools": TOOLS, "tool_choice": "required", RF: JSON_OBJECT}, RF, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "x"}, "guided_regex", "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", ""),
    ],
)
def test_bad_tools_are_400s_naming_their_field(app, engine, body, param, mentions):
    refused(chat(app, **body), param, mentions)
    assert not engine.sent


def test_tools_need_a_tool_call_format(app, gw, engine, monkeypatch):
    monkeypatch.setattr(gw.text, "tool_call_parser", None)
    refused(chat(app, tools=[WEATHER]), "tools", "--tool-call-parser")
    assert chat(app, tools=[WEATHER], tool_choice="none").status_code == 200  # no parsing needed


def test_tool_messages_and_assistant_calls_are_accepted(app, gw, engine):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = chat(app, messages=messages, tools=[WEATHER])
    assert r.status_code == 200, r.text
    prompt = gw.tokenizer.decode(engine.sent[-1][0])
    assert '"city": "Paris"' in prompt and "<tool_response>\nsunny" in prompt
    refused(
        chat(app, messages=[*USER, {"role": "tool", "content": "x"}]),
        "messages.1.tool_call_id",
        "tool_call_id",
    )
    bad = [{"role": "user", "content": "x", "tool_calls": [call]}]
    refused(chat(app, messages=bad), "messages.0.tool_calls", "assistant")
    bad = [{"role": "user", "content": "x", "tool_call_id": "call_1"}]
    refused(chat(app, messages=bad), "messages.0.tool_call_id", "tool")


def test_a_tool_call_comes_back_as_tool_calls(app, engine):
    engine.script = lambda k, ids, sp: [text(CALL_TEXT, [9] * 5, "stop")]
    r = chat(app, tools=[WEATHER])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None and msg["role"] == "assistant"
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # cut by max_tokens: still parsed, the reason stays length
    engine.script = lambda k, ids, sp: [text("I will check. " + CALL_TEXT, [9] * 5, "length")]
    choice = chat(app, tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "I will check."
    # tool_choice none: text stays text
    engine.script = lambda k, ids, sp: [text(CALL_TEXT, [9] * 5, "stop")]
    choice = chat(app, tools=[WEATHER], tool_choice="none").json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALL_TEXT}
    assert choice["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(app, engine):
    engine.script = lambda k, ids, sp: [
        text(CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome"), [9], "stop")
    ]
    assert len(chat(app, tools=[WEATHER]).json()["choices"][0]["message"]["tool_calls"]) == 2
    (call,) = chat(app, tools=[WEATHER], parallel_tool_calls=False).json()["choices"][0]["message"][
        "tool_calls"
    ]
    assert "Paris" in call["function"]["arguments"]


def test_streamed_tool_calls_come_as_deltas(app, engine):
    cut = [CALL_TEXT[:5], CALL_TEXT[5:30], CALL_TEXT[30:]]
    engine.script = lambda k, ids, sp: [
        text("Let me look. ", [1]),
        *(text(p, [2]) for p in cut),
        text("", [], "stop"),
    ]
    chunks = events(chat(app, tools=[WEATHER], stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me look."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_lone_surrogate_inside_a_schema_is_a_400(app, engine):
    bad = {"type": "object", "properties": {"\ud800": {"type": "string"}}}
    refused(complete(app, guided_json=bad), "guided_json", "Unicode")
    refused(chat(app, tools=[function(name="f", parameters=bad)]), "tools.0.function.parameters", "Unicode")


# ------------------------------------------------------------------------- refusals and limits
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": choice}, "tool_choice")
        for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "f"}})
    ]
    + [({"parallel_tool_calls": False}, "parallel_tool_calls")],
)
def test_tool_fields_without_tools_are_400s(app, engine, body, param):
    refused(chat(app, **body), param, "tools")
    assert not engine.sent


@pytest.mark.parametrize("make", [complete, chat])
def test_stream_options_need_stream(app, engine, make):
    refused(make(app, stream_options={"include_usage": True}), "stream_options", "stream")
    refused(make(app, stream=False, stream_options={}), "stream_options", "stream")
    assert not engine.sent
    assert make(app, stream=True, stream_options={"include_usage": True}).status_code == 200


@pytest.mark.parametrize("prompt", ["", [""], [[]], [[5], []], []])
def test_an_empty_prompt_is_the_gateways_400(app, engine, prompt):
    refused(complete(app, prompt=prompt), "prompt", "empty")
    refused(complete(app, prompt=prompt, echo=True, max_tokens=0), "prompt", "empty")
    assert not engine.sent


def test_usage_null_on_every_chunk_before_the_last(app, engine):
    for make in (chat, complete):
        chunks = events(make(app, n=2, stream=True, stream_options={"include_usage": True}))
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
        assert chunks[-1]["usage"]["completion_tokens"] == 2 and chunks[-1]["choices"] == []


def test_the_top_seed_with_n_wraps_into_64_bits(app, gw, monkeypatch):
    """Choice i's seed is seed + i wrapped into int64: the top seed's second choice is the bottom one."""
    sent: list[pb.TokenizedRequest] = []

    class Stub:
        async def Submit(self, request: pb.TokenizedRequest, timeout: float) -> None:
            sent.append(request)
            done = pb.RequestText(rid=request.rid, text="ok", token_ids=[7], finish_reason="stop")
            gw.deliver(pb.TextBatch(reqs=[done]), object())

    class Pod:  # a scheduler that answers every request at once
        address, stub, outstanding, sent = "pod", Stub(), set(), 0

    monkeypatch.setattr(gw, "_route", lambda ids, trace, avoid=None: Pod())
    r = chat(app, seed=2**63 - 1, n=2)
    assert r.status_code == 200, r.text
    assert [q.sampling.seed for q in sent] == [2**63 - 1, -(2**63)]
