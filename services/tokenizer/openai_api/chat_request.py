"""The /v1/chat/completions request: messages, tools, the chat template's options, and what the
schema cannot say per field (pure: no I/O). The fields both endpoints share, and how a request maps to
SamplingParams, are requests.py's; what each field does is fields.FIELDS'."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.common.sampling import MAX_LOGPROBS, MAX_TOKENS, Constraint, SamplingParams
from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.openai_api.requests import (
    MAX_MESSAGES,
    MAX_TOOLS,
    FunctionName,
    JsonObject,
    Name,
    Source,
    Text,
    _Sampling,
    _Strict,
)
from radixserve.tokenizer.text.tool_grammar import validate_tools


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class RefusalPart(_Strict):
    """An assistant's refusal, as OpenAI's own messages carry it: text here."""

    type: Literal["refusal"]
    refusal: Text


class MediaPart(BaseModel):
    """An image, audio, video or file part: refused by its type (fields.py), whatever it holds."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["image_url", "input_audio", "file", "video_url", "audio_url"]


ContentPart = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: Name
    arguments: Text  # JSON text, as the model wrote it


class MessageToolCall(_Strict):
    id: Name
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None  # passed to the chat template
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Name | None = None  # tool: the call this message answers
    refusal: Text | None = None  # assistant: its past refusal (OpenAI's own messages carry null)
    reasoning_content: Text | None = None  # assistant: its past reasoning (vLLM, SGLang)
    audio: Any = None  # refused unless null (fields.py)
    function_call: Any = None
    annotations: Any = None  # ignored (fields.py)

    def text(self) -> str:
        """The content as one text (text and refusal parts joined); an empty one's refusal instead."""
        if isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(
                p.text if isinstance(p, TextPart) else p.refusal if isinstance(p, RefusalPart) else ""
                for p in self.content or ()
            )
        return text or self.refusal or ""

    def openai_dict(self) -> dict[str, object]:
        """The message as OpenAI's plain shape (content parts joined; unset fields left out), what
        tool_calls.template_messages turns into the chat template's."""
        dropped = {"refusal", "audio", "function_call", "annotations"}
        out = self.model_dump(exclude_none=True, by_alias=True, exclude=dropped)
        if self.content is not None or self.refusal is not None:
            out["content"] = self.text()
        elif self.tool_calls is None:
            out["content"] = ""  # templates concatenate content: a bare None would fail there
        return out


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(le=MAX_TOKENS)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's and SGLang's chat extensions.
    chat_template_kwargs: JsonObject | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    separate_reasoning: bool = True
    # Accepted and ignored, or refused unless neutral: fields.FIELDS says which and why.
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    prediction: Any = None
    modalities: Any = None
    audio: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    functions: Any = None
    function_call: Any = None
    stream_reasoning: Any = None
    echo: Any = None
    documents: Any = None
    chat_template: Any = None
    tool_parser: Any = None
    input_ids: Any = None
    return_prompt_token_ids: Any = None
    return_meta_info: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    use_audio_in_video: Any = None
    task: Any = None

    def template_variables(self) -> dict[str, object]:
        """chat_template_kwargs, with reasoning_effort for templates that take it, and as the thinking
        switch of those that have one (none: off; any other effort: on), unless the kwargs set it."""
        variables: dict[str, object] = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            thinking = self.reasoning_effort != "none"
            variables.setdefault("reasoning_effort", self.reasoning_effort)
            variables.setdefault("enable_thinking", thinking)  # Qwen3's switch
            variables.setdefault("thinking", thinking)  # DeepSeek-V3.1's
        return variables

    @property
    def opens_a_turn(self) -> bool:
        return opens_a_turn(self.add_generation_prompt, self.continue_final_message, self.model_fields_set)

    def check_fields(self) -> None:
        """What the schema cannot say field by field: a 400 naming the field."""
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: let it pass, as before
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        # OpenAI refuses both without tools, whatever their value: they would silently do nothing.
        for name in ("tool_choice", "parallel_tool_calls"):
            if self.tools is None and getattr(self, name) is not None:
                raise ApiError(400, f"{name} is only allowed when tools are given", param=name)
        if isinstance(self.tool_choice, NamedToolChoice):
            named = self.tool_choice.function.name
            if named not in {t.function.name for t in self.tools or ()}:
                raise ApiError(
                    400, f"tool_choice names {named!r}, which is not among tools", param="tool_choice"
                )

    @property
    def calls_tools(self) -> bool:
        """Whether the model may call tools (then its output is parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict[str, object]] | None:
        """``tools`` as OpenAI-shaped dicts (what HF chat templates take); None with tool_choice none:
        the model is not to call them, so they are left out of its prompt (vLLM renders them; here the
        output cannot then be a call the client would get as text)."""
        return tool_dicts(self.tools) if self.calls_tools else None

    def tool_choice_value(self) -> str | dict[str, object]:
        """``tool_choice`` as OpenAI's plain value (its default: auto when tools are given)."""
        tc = self.tool_choice or "auto"
        return tc if isinstance(tc, str) else tc.model_dump()

    def output_constraint(self, tool_constraint: Constraint | None) -> Source | None:
        """The one constraint on the output and the field that asked: ``constraint()``'s, or
        ``tool_constraint`` (the grammar a forcing tool_choice imposes), never both."""
        source = self.constraint()
        if tool_constraint is None:
            return source
        if source is not None:
            msg = f"{source[0]} cannot be combined with tool_choice {self.tool_choice_value()!r}"
            raise ApiError(400, msg, param=source[0])
        return "tool_choice", tool_constraint

    def sampling_params(self, max_new_tokens: int, vocab_size: int, source: Source | None) -> SamplingParams:
        """This request's SamplingParams (raises ApiError naming the field); ``source``: its
        ``output_constraint``, computed once by the caller."""
        sp = self._sampling(max_new_tokens, vocab_size, source[1] if source else None)
        sp.logprobs = (self.top_logprobs or 0) if self.logprobs else None
        tokens_field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        names = {"max_new_tokens": tokens_field, "logprobs": "top_logprobs", "min_new_tokens": "min_tokens"}
        return self._checked(sp, {**names, "constraint": source[0] if source else "response_format"})


def opens_a_turn(add_generation_prompt: bool, continue_final_message: bool, fields_set: set[str]) -> bool:
    """add_generation_prompt, off by default when continuing the last message (SGLang's rule)."""
    if continue_final_message and "add_generation_prompt" not in fields_set:
        return False
    return add_generation_prompt


def tool_dicts(tools: list[ChatTool] | None) -> list[dict[str, object]] | None:
    """``tools`` as OpenAI-shaped dicts (what HF chat templates take), checked by validate_tools (what
    the schema cannot say: duplicate names, parameters of type object): once per request, here."""
    if not tools:
        return None
    dicts = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    try:
        validate_tools(dicts)
    except ValueError as e:
        raise ApiError(400, str(e), param="tools") from e
    return dicts


def template_messages(messages: list[ChatMessage]) -> list[dict[str, object]]:
    """The messages checked (what the schema cannot say per message) and in OpenAI's plain shape: the
    one conversion /v1/chat/completions and /v1/tokenize share, so a count is the prompt's."""
    for i, m in enumerate(messages):
        _check_message(i, m)
    return [m.openai_dict() for m in messages]


def _check_message(i: int, m: ChatMessage) -> None:
    where = f"messages.{i}"
    if m.tool_calls is not None and m.role != "assistant":
        raise ApiError(400, f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
    if m.role == "tool" and m.tool_call_id is None:
        raise ApiError(400, f"{where}: a tool message needs tool_call_id", param=f"{where}.tool_call_id")
    if m.tool_call_id is not None and m.role != "tool":
        raise ApiError(400, f"{where}: only tool messages carry tool_call_id", param=f"{where}.tool_call_id")
