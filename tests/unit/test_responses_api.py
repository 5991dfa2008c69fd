"""The Responses API at the gateway (radixserve.tokenizer.openai_api.responses_route) over scripted
schedulers: bodies and streamed events validated against the OpenAI SDK's own types, the conversion of
input items to the chat template's messages, function calls and their outputs, previous_response_id
over the store (per API key, bounded), and the errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from radixserve.tokenizer.openai_api.response_store import MemoryResponseStore, StoredResponse
from tests.helpers.gateway import CALL_TEXT, MODEL, ScriptedSchedulers, post, refused, text

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def create(app: Any, **body: Any) -> httpx.Response:
    return post(app, "/v1/responses", {"model": MODEL, "input": "hello", **body})


def say(engine: ScriptedSchedulers, *pieces: str, finish: str = "stop") -> None:
    engine.script = lambda k, ids, sp: [
        *(text(p, [5], done=i + 1) for i, p in enumerate(pieces[:-1])),
        text(pieces[-1], [5], finish, done=len(pieces)),
    ]


def stream_events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    out, kind = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == kind
            EVENTS.validate_python(data)  # the SDK's own event types accept it
            out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def prompt_of(engine: ScriptedSchedulers, gw: Any) -> str:
    return str(gw.tokenizer.decode(engine.sent[-1][0], skip_special_tokens=False))


def test_a_plain_response(app, gw, engine):
    say(engine, "Hi ", "there.")
    r = create(app, instructions="Be brief.", max_output_tokens=5, metadata={"team": "a"})
    body = Response.model_validate(r.json())
    assert body.status == "completed" and body.output_text == "Hi there." and body.id.startswith("resp_")
    assert body.usage is not None and body.usage.output_tokens == 2 and body.usage.input_tokens > 0
    assert body.metadata == {"team": "a"} and body.instructions == "Be brief."
    prompt = prompt_of(engine, gw)
    assert (
        prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "<|im_start|>user\nhello" in prompt
    )
    assert engine.sent[-1][1].max_new_tokens == 5


def test_a_response_streams_the_documented_events(app, engine):
    say(engine, "Hi ", "there.")
    events = stream_events(create(app, stream=True))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hi there."
    done = Response.model_validate(events[-1]["response"])
    assert done.output_text == "Hi there." and done.status == "completed"


def test_max_output_tokens_makes_an_incomplete_response(app, engine):
    say(engine, "Hi", finish="length")
    body = create(app, max_output_tokens=1).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert stream_events(create(app, max_output_tokens=1, stream=True))[-1]["type"] == "response.incomplete"


def test_a_function_call_round_trip_over_previous_response_id(app, gw, engine):
    say(engine, CALL_TEXT[:20], CALL_TEXT[20:])
    events = stream_events(create(app, tools=[WEATHER], tool_choice="required", stream=True))
    kinds = [e["type"] for e in events]
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    first = Response.model_validate(events[-1]["response"])
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert engine.sent[-1][1].constraint is not None  # required: a grammar forced the call
    say(engine, "It is sunny.")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
    r = create(app, previous_response_id=first.id, input=[output], tools=[WEATHER])
    assert Response.model_validate(r.json()).output_text == "It is sunny."
    prompt = prompt_of(engine, gw)
    # the stored conversation came first: the question, the call, then the tool's answer
    assert (
        prompt.index("user\nhello")
        < prompt.index('"get_weather", "arguments"')
        < prompt.index('{"sky": "clear"}')
    )


def test_output_items_sent_back_as_input_keep_the_conversation(app, gw, engine):
    """What the SDK's users do without a store: the last output items resent with the next input."""
    say(engine, CALL_TEXT)
    first = create(app, tools=[WEATHER], tool_choice="required").json()
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        *first["output"],
        {"type": "function_call_output", "call_id": first["output"][0]["call_id"], "output": "sunny"},
    ]
    say(engine, "ok")
    assert create(app, input=items, tools=[WEATHER], store=False).status_code == 200
    prompt = prompt_of(engine, gw)
    assert '<tool_call>\n{"name": "get_weather"' in prompt and "<tool_response>\nsunny" in prompt


def test_text_format_json_schema_is_a_structured_output(app, engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    say(engine, '{"a": 1}')
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    body = create(app, text={"format": fmt}).json()
    assert json.loads(body["output"][0]["content"][0]["text"]) == {"a": 1}
    assert engine.sent[-1][1].constraint is not None and engine.sent[-1][1].constraint.kind == "json_schema"
    refused(create(app, text={"format": {"type": "json_schema", "schema": schema}}), "text.format.name")


def test_stored_responses_are_read_and_deleted_per_api_key(app, engine):
    say(engine, "stored")
    rid = create(app).json()["id"]
    got = httpx_get(app, f"/v1/responses/{rid}")
    assert got.status_code == 200 and Response.model_validate(got.json()).output_text == "stored"
    assert httpx_get(app, f"/v1/responses/{rid}", key="someone-else").status_code == 404
    r = create(app, previous_response_id=rid, store=False)
    assert r.status_code == 200
    assert httpx_delete(app, f"/v1/responses/{rid}").json() == {
        "id": rid,
        "object": "response.deleted",
        "deleted": True,
    }
    assert httpx_get(app, f"/v1/responses/{rid}").status_code == 404
    r = create(app, previous_response_id=rid)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    unstored = create(app, store=False).json()["id"]
    assert httpx_get(app, f"/v1/responses/{unstored}").status_code == 404


def test_errors_name_this_endpoints_fields(app, engine):
    refused(create(app, input=[{"type": "item_reference", "id": "x"}]), "input.0", "input items are")
    refused(
        create(app, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
        "input.0.content.0.type",
    )
    refused(create(app, tools=[{"type": "web_search"}]), "tools.0.type")
    refused(create(app, max_output_tokens=0), "max_output_tokens")
    refused(create(app, background=True), "background", "not supported by this server")
    refused(create(app, temperature=3), "temperature")


@pytest.mark.asyncio
async def test_the_memory_store_is_bounded_by_count_bytes_and_age():
    now = [0.0]
    store = MemoryResponseStore(max_entries=2, max_bytes=400, ttl_s=10, clock=lambda: now[0])
    record = StoredResponse({"id": "r"}, [{"role": "user", "content": "x" * 50}])
    for rid in ("a", "b", "c"):
        await store.put("o", rid, record)
    assert await store.get("o", "a") is None and await store.get("o", "c") is not None  # count
    await store.put("o", "big", StoredResponse({"id": "r"}, [{"content": "y" * 300}]))
    assert await store.get("o", "b") is None and store.bytes <= 400  # bytes
    now[0] = 11
    assert await store.get("o", "big") is None  # age
    await store.put("o", "huge", StoredResponse({}, [{"content": "z" * 1000}]))
    assert await store.get("o", "huge") is None  # larger than the store: not kept


def httpx_get(app: Any, path: str, key: str | None = None) -> httpx.Response:
    return _call(app, "GET", path, key)


def httpx_delete(app: Any, path: str) -> httpx.Response:
    return _call(app, "DELETE", path, None)


def _call(app: Any, method: str, path: str, key: str | None) -> httpx.Response:
    import asyncio

    async def go() -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as h:
            return await h.request(method, path, headers=headers)

    return asyncio.run(go())
