"""The openai SDK's Responses API against the served cluster (plain, streamed, a function tool round
trip over previous_response_id, retrieve and delete) and histories made of the SDK's own objects
(``message.model_dump()`` and output items) sent back as input. The thinking switch is off for
calls (reasoning effort "none"), so a forced call comes first."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.cluster import MODEL_NAME

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
OFF = {"effort": "none"}
# one call of get_weather, forced by a grammar, with the thinking switch off
FORCED = {
    "tools": [WEATHER],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "max_output_tokens": 64,
}


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def test_a_plain_and_a_streamed_response(client):
    r = client.responses.create(model=MODEL_NAME, input="Say hi", max_output_tokens=6, reasoning=OFF)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    with client.responses.stream(model=MODEL_NAME, input="Say hi", max_output_tokens=6, reasoning=OFF) as s:
        events = list(s)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert len(deltas) > 1 and "".join(deltas) == events[-1].response.output_text


def test_a_function_call_round_trip(client):
    first = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", reasoning=OFF, **FORCED)
    assert first.status == "completed"
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and len(json.loads(call.arguments)["city"]) <= 8
    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
        max_output_tokens=4,
        reasoning=OFF,
    )
    assert second.previous_response_id == first.id and second.output_text
    # the conversation behind it: the stored question and call came before the tool's answer
    assert second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_streamed_function_call_is_parsed_by_the_sdk(client):
    with client.responses.stream(model=MODEL_NAME, input="Weather?", reasoning=OFF, **FORCED) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()  # the SDK's helper rebuilds the response from the events
    assert kinds.count("response.function_call_arguments.delta") > 1
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] is not None


def test_sdk_objects_sent_back_as_history(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    dumped = chat.choices[0].message.model_dump()  # refusal, annotations, audio, function_call: null
    again = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}, dumped, {"role": "user", "content": "more"}],
        max_tokens=4,
    )
    assert again.choices[0].message.content is not None
    first = client.responses.create(
        model=MODEL_NAME, input="hi", max_output_tokens=4, reasoning=OFF, store=False
    )
    items = [
        {"role": "user", "content": "hi"},
        *(o.model_dump() for o in first.output),
        {"role": "user", "content": "more"},
    ]
    second = client.responses.create(
        model=MODEL_NAME, input=items, max_output_tokens=4, reasoning=OFF, store=False
    )
    assert second.output_text
