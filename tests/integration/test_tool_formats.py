"""Tool calls in Llama 3's JSON format through the real server and the openai SDK: a model folder
whose chat template is Llama-3.1-style gets the ``llama3_json`` parser picked from its template, and
forced calls come back as ``tool_calls`` (streamed and not) with arguments valid for the tool. The
Hermes format (the demo template's) is covered in test_openai_fields.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from radixserve.common.demo_model import LLAMA3_CHAT_TEMPLATE, make_demo_model
from tests.helpers.cluster import MODEL_NAME, start_cluster

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    # additionalProperties false: an open object lets a random-weight model add keys until max_tokens
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


@pytest.fixture(scope="module")
def llama3_cluster(tmp_path_factory):
    path = make_demo_model(tmp_path_factory.mktemp("llama3") / "m", arch="llama", size="tiny")
    (path / "chat_template.jinja").write_text(LLAMA3_CHAT_TEMPLATE)
    cluster = start_cluster(path, schedulers=1)
    yield cluster
    cluster.stop(drain_timeout=5)


def test_the_llama3_template_gets_the_llama3_json_parser_and_forced_calls_validate(llama3_cluster):
    c = openai.OpenAI(base_url=f"{llama3_cluster.url}/v1", api_key="unused", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "Weather in Rome for 3 days?"}]
    r = c.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=1.0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    # the call goes back as history (rendered as Llama 3 renders past calls) with the tool's answer
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = c.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=5)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")

    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME, messages=messages[:1], tools=TOOLS, tool_choice="required", max_tokens=80,
            parallel_tool_calls=False, stream=True, seed=5,
        )
    )  # fmt: skip
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert (
        len({d.index for d in deltas}) == 1
        and deltas[0].id
        and deltas[0].function.name in ("get_weather", "get_time")
    )
    args = json.loads("".join(d.function.arguments or "" for d in deltas))
    if deltas[0].function.name == "get_weather":
        jsonschema.validate(args, PARAMS)
    else:
        assert args == {}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
