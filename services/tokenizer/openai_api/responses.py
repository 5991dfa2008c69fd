"""OpenAI's Responses API (``POST /v1/responses``) as a front end of the chat pipeline (pure: no I/O).

A request becomes a chat request: ``instructions`` a first system message, the stored conversation
of ``previous_response_id`` next (without that response's instructions, as OpenAI documents), then
``input``: messages as messages, ``function_call`` items as an assistant's tool calls,
``function_call_output`` items as tool messages, ``reasoning`` items as the next assistant message's
reasoning_content. ``tools`` (function tools), ``tool_choice``, ``text.format`` (structured outputs),
``reasoning.effort``, ``max_output_tokens``, ``temperature`` and ``top_p`` map to their chat
counterparts, so limits and errors are chat's. The output comes back as Responses items: a
``reasoning`` item (with --reasoning-parser), a ``message`` with ``output_text``, ``function_call``
items. What each request field does is fields.FIELDS' (endpoint ``responses``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.openai_api.bodies import ToolCallBody
from radixserve.tokenizer.openai_api.choices import ChatAnswer
from radixserve.tokenizer.openai_api.requests import (
    MAX_MESSAGES,
    MAX_TOOLS,
    FunctionName,
    JsonObject,
    Name,
    Text,
    _Strict,
)

Json = dict[str, Any]


# ------------------------------------------------------------------------------------ request
class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Any = None  # an output_text's, sent back as they came: nothing to do with them
    logprobs: Any = None


class InputRefusal(_Strict):
    type: Literal["refusal"]
    refusal: Text


class InputMedia(BaseModel):
    """An image, file or audio part: refused by its type (fields.py), whatever it holds."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]


InputPart = Annotated[InputText | InputRefusal | InputMedia, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[InputPart], Field(max_length=MAX_MESSAGES)]
    id: Name | None = None  # an output message sent back: its id is not needed
    status: Any = None
    phase: Any = None  # the SDK's model_dump() of an output message carries it

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(
            p.text if isinstance(p, InputText) else p.refusal if isinstance(p, InputRefusal) else ""
            for p in self.content
        )


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Name
    name: FunctionName
    arguments: Text
    id: Name | None = None
    status: Any = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Name
    output: Text | Annotated[list[InputPart], Field(max_length=MAX_MESSAGES)]
    id: Name | None = None
    status: Any = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output if isinstance(p, InputText))


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: Name | None = None
    summary: Annotated[list[ReasoningText], Field(max_length=MAX_MESSAGES)] = Field(default_factory=list)
    content: Annotated[list[ReasoningText], Field(max_length=MAX_MESSAGES)] | None = None
    encrypted_content: Any = None  # none is made here; one sent back means nothing here
    status: Any = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(v: object) -> str | None:
    # OpenAI's "easy" input message has no type: a message.
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in _ITEM_TYPES else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_input_item",
        custom_error_message=f"input items are {', '.join(_ITEM_TYPES)} (other item types are not served)",
    ),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None  # json_schema
    schema_: JsonObject | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Any = None  # refused unless neutral (fields.py)


class ReasoningOptions(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Any = None  # ignored (fields.py)
    generate_summary: Any = None


class ResponseStreamOptions(_Strict):
    include_obfuscation: Any = None  # ignored (fields.py)


def _message(role: str, content: str) -> MessageItem:
    return MessageItem(role=role, content=content)  # type: ignore[arg-type]


class ResponseRequest(_Strict):
    model: Annotated[Text, Field(max_length=512)]
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    previous_response_id: Name | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    store: bool = True
    ignore_eos: bool = False  # vLLM's extension (benchmarks send it)
    metadata: Annotated[dict[str, Annotated[Text, Field(max_length=512)]], Field(max_length=16)] | None = None
    # Accepted and ignored, or refused unless neutral: fields.FIELDS says which and why.
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    max_tool_calls: Any = None
    include: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    image: Any = None
    moderation: Any = None
    service_tier: Any = None
    access_programs: Any = None

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [_message("user", self.input)]
        return list(self.input)

    def chat_body(self, history: Sequence[Json]) -> Json:
        """This request as a /v1/chat/completions body after ``history`` (the stored conversation of
        previous_response_id, as chat messages)."""
        messages: list[Json] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        messages += history
        messages += chat_messages(self.input_items())
        body: Json = {
            "ignore_eos": self.ignore_eos,
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": t.model_dump(exclude_none=True, by_alias=True, exclude={"type"}),
                }
                for t in self.tools
            ]
            if self.tool_choice is not None:
                tc = self.tool_choice
                body["tool_choice"] = (
                    tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
                )
            if self.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = self.parallel_tool_calls
        elif self.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = _response_format(fmt)
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return body


def _response_format(fmt: TextFormat) -> Json:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None:
        raise ApiError(400, "text.format.name is required for json_schema", param="text.format.name")
    spec: Json = {"name": fmt.name}
    for key, value in (("schema", fmt.schema_), ("description", fmt.description), ("strict", fmt.strict)):
        if value is not None:
            spec[key] = value
    return {"type": "json_schema", "json_schema": spec}


def chat_messages(
    items: Sequence[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
) -> list[Json]:
    """Input items as chat messages: consecutive assistant output (its message, its calls) is one
    assistant message, as a chat template expects a turn; a reasoning item goes to the next one."""
    out: list[Json] = []
    reasoning: str | None = None

    def assistant() -> Json:
        nonlocal reasoning
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":
            return last
        m: Json = {"role": "assistant", "content": None}
        if reasoning is not None:
            m["reasoning_content"], reasoning = reasoning, None
        out.append(m)
        return m

    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
        elif isinstance(item, MessageItem):
            if item.role == "assistant":
                m = assistant()
                m["content"] = (m["content"] or "") + item.text()
            else:
                out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            assistant().setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def assistant_message(answer: ChatAnswer) -> Json:
    """A response's output as the assistant message a follow-up request's history holds."""
    m: Json = {"role": "assistant", "content": answer.content}
    if answer.reasoning:
        m["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        m["tool_calls"] = [dict(c) for c in answer.tool_calls]
    return m


# ------------------------------------------------------------------------------------ output
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> Json:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> Json:
    """``text`` None: no part yet (the item as streaming announces it)."""
    parts = [output_text(text)] if text is not None else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def output_text(text: str) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call: ToolCallBody, arguments: str, status: str = "completed") -> Json:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": arguments,
        "status": status,
    }


def output_items(answer: ChatAnswer, cut: bool = False) -> list[Json]:
    """``answer`` as output items; ``cut``: max_output_tokens ended it, inside its last item."""
    items: list[Json] = []
    if answer.reasoning:
        items.append(reasoning_item(new_id("rs"), answer.reasoning))
    if answer.content:
        items.append(message_item(new_id("msg"), answer.content))
    for call in answer.tool_calls:
        items.append(function_call_item(new_id("fc"), call, call["function"]["arguments"]))
    if cut and items:
        items[-1]["status"] = "incomplete"
    return items


def usage(prompt: int, completion: int, cached: int, reasoning: int) -> Json:
    return {
        "input_tokens": prompt,
        # the prompt's tokens the prefix cache did not hold: they are in it now (the radix cache keeps
        # every prefill)
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def response_object(
    response_id: str,
    body: ResponseRequest,
    model: str,
    created_at: int,
    status: str,
    output: list[Json],
    use: Json | None = None,
    incomplete: str | None = None,
    error: Mapping[str, object] | None = None,
) -> Json:
    """The Response, as every event and GET /v1/responses/{id} show it."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools or ()]
    tc = body.tool_choice or "auto"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "status": status,
        "error": dict(error) if error is not None else None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store,
        "temperature": body.temperature,
        "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
        "tool_choice": tc if isinstance(tc, str) else tc.model_dump(),
        "tools": tools,
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": use,
        "user": None,
        "metadata": body.metadata or {},
    }
