"""langchain-openai's ChatOpenAI against the served cluster, as its users call it: named messages,
with_structured_output (json_schema and function_calling), bind_tools with streamed tool_call_chunks,
and the Responses API (use_responses_api=True). The thinking switch is off (the model's template
takes enable_thinking) so the answers start at once."""

from __future__ import annotations

import operator
from functools import reduce

import pytest
from pydantic import BaseModel, Field

from tests.helpers.cluster import MODEL_NAME

pytestmark = pytest.mark.slow

langchain_openai = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


class get_weather(BaseModel):  # a tool is named after its class
    """The weather in a city."""

    city: str = Field(max_length=8)


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def chat_model(served, **kw):
    return langchain_openai.ChatOpenAI(
        model=MODEL_NAME, base_url=f"{served.url}/v1", api_key="unused", temperature=0, max_retries=0, **kw
    )


def test_named_messages(served):
    llm = chat_model(served, max_tokens=8, extra_body=NO_THINKING)
    history = [
        messages.SystemMessage("Be brief.", name="rules"),
        messages.HumanMessage("hi", name="alice"),
        messages.AIMessage("hello", name="bot"),
        messages.HumanMessage("and now?", name="alice"),
    ]
    out = llm.invoke(history)
    assert isinstance(out.content, str) and out.content
    assert out.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(served, method):
    llm = chat_model(served, max_tokens=64, extra_body=NO_THINKING)
    person = llm.with_structured_output(Person, method=method).invoke("Who is she?")
    assert isinstance(person, Person) and len(person.name) <= 8 and 0 <= person.age <= 120


def test_bind_tools_streams_tool_call_chunks(served):
    llm = chat_model(served, max_tokens=64, extra_body=NO_THINKING)
    chunks = list(llm.bind_tools([get_weather], tool_choice="get_weather").stream("Weather in Paris?"))
    with_calls = [c for c in chunks if c.tool_call_chunks]
    assert len(with_calls) >= 3, "the call came in one piece, not as it was generated"
    assert with_calls[0].tool_call_chunks[0]["name"] == "get_weather"
    whole = reduce(operator.add, chunks)
    (call,) = whole.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    assert whole.response_metadata["finish_reason"] == "tool_calls"


def test_the_responses_api(served):
    llm = chat_model(served, max_tokens=8, use_responses_api=True, reasoning={"effort": "none"})
    out = llm.invoke("hi")
    assert out.text
    streamed = reduce(operator.add, llm.stream("hi"))
    assert streamed.text
    structured = chat_model(served, max_tokens=64, use_responses_api=True, reasoning={"effort": "none"})
    person = structured.with_structured_output(Person, method="json_schema").invoke("Who is she?")
    assert isinstance(person, Person)
