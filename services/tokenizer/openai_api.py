"""OpenAI-compatible request schemas and their SamplingParams (pure: no I/O). The response bodies are
openai_responses.py's.

One schema per endpoint, strict and bounded, so bad input is a 400 that names the field, never a
500 further in:
- types are strict (a string where a number belongs is a 400, not a coercion); NaN and Infinity
  are refused; integers are bounded to what the gRPC contract carries (token ids and lengths int32,
  seeds int64); strings must be valid Unicode (no lone surrogates);
- ranges are SamplingParams.validate's, the one check the gRPC front door and the Engine share (its
  parameter names are mapped back to the request's own: ``max_new_tokens`` is ``max_tokens``, ...);
- structured output comes from one source per request: OpenAI's ``response_format``, vLLM's
  ``guided_json`` / ``guided_regex`` / ``guided_choice``, or a chat's forcing ``tool_choice``;
- ``best_of`` (other than ``n``) and ``suffix`` are not implemented: a 400 naming them
  (``unsupported``); ``user`` is accepted and ignored on purpose (it labels requests for the
  provider's abuse monitoring); any other field is refused as unknown.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from radixserve.common.sampling import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_TOKENS,
    SEED_BITS,
    Constraint,
    SamplingError,
    SamplingParams,
)
from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.tool_grammar import FUNCTION_NAME, validate_tools

MAX_N = 16
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's limit
MAX_CHOICES = 1024  # guided_choice's strings
MAX_NAME = 256  # ids and names a client echoes back (tool call ids, message names)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (gRPC Generate: the same)


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone UTF-16 surrogate)") from None
    return s


def _valid_unicode_json(value: dict[str, object]) -> dict[str, object]:
    """Every key and string in a JSON object (a schema) valid Unicode: such text goes into prompts,
    grammars and protobuf strings, which cannot hold a lone surrogate."""
    stack: list[object] = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            _valid_unicode(x)
        elif isinstance(x, dict):
            stack += [*x.keys(), *x.values()]
        elif isinstance(x, list):
            stack += x
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Name = Annotated[Text, Field(max_length=MAX_NAME)]
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME)]
JsonObject = Annotated[dict[str, object], AfterValidator(_valid_unicode_json)]
Choices = Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]


Source = tuple[str, Constraint]  # a constraint on the output, and the field that asked for it


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


# ---------------------------------------------------------------------------- response_format
class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: FunctionName
    description: Text | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted: the schema is always enforced (llguidance masks every step)


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


_FORMATS = {"text": "TextFormat", "json_object": "JsonObjectFormat", "json_schema": "JsonSchemaFormat"}


def _format_tag(v: object) -> str | None:
    # Tagged by class name, not by the type's value: an error's location then holds the class name,
    # which validation_message leaves out ("response_format.json_schema.name", said once).
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return _FORMATS.get(kind) if isinstance(kind, str) else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("TextFormat")]
    | Annotated[JsonObjectFormat, Tag("JsonObjectFormat")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchemaFormat")],
    Discriminator(
        _format_tag,
        custom_error_type="invalid_response_format",
        custom_error_message="type must be one of text, json_object, json_schema",
    ),
]


def _format_constraint(rf: TextFormat | JsonObjectFormat | JsonSchemaFormat) -> Constraint | None:
    if isinstance(rf, JsonSchemaFormat) and rf.json_schema.schema_ is not None:
        return Constraint("json_schema", json.dumps(rf.json_schema.schema_, ensure_ascii=False))
    if isinstance(rf, TextFormat):
        return None
    return Constraint("json_object")  # json_object, or a json_schema without a schema: any object


def _guided_json(value: JsonObject | str) -> Constraint:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"guided_json is not valid JSON: {e}", param="guided_json") from None
        if not isinstance(parsed, dict):
            raise ApiError(400, "guided_json must be a JSON schema (an object)", param="guided_json")
        return Constraint("json_schema", value)
    return Constraint("json_schema", json.dumps(value, ensure_ascii=False))


# ------------------------------------------------------------------------------ common fields
class _Sampling(_Strict):
    model: Annotated[Text, Field(max_length=512)]
    max_tokens: Annotated[int, Field(le=MAX_TOKENS)] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Annotated[int, Field(ge=-(2**31), le=MAX_TOKENS)] = -1
    min_p: float = 0.0
    seed: Annotated[int, Field(ge=-(2 ** (SEED_BITS - 1)), le=2 ** (SEED_BITS - 1) - 1)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=64)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[Text, Field(max_length=512)] | None = None  # accepted and ignored on purpose
    # Ranges: SamplingParams.validate's (the same words as over gRPC).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's shape: token ids as strings; the vocabulary is checked with the model's (logit_bias_ids).
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions for structured output.
    guided_json: JsonObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Choices | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_stream_options(self) -> None:
        """vLLM's rule: stream_options only with stream (a non-streamed body has its usage anyway)."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to something this server does not do: (field, message)."""
        for name, value, neutral in self._optional_features():
            if value not in neutral:
                return name, f"{name}={value!r} is not supported by this server (only {neutral[0]!r})"
        return None

    def _optional_features(self) -> list[tuple[str, object, tuple[object, ...]]]:
        return []

    def constraint(self) -> Source | None:
        """The structured output asked for and the field that asked; a 400 for more than one."""
        found: list[tuple[str, Constraint]] = []
        if self.response_format is not None and (c := _format_constraint(self.response_format)):
            found.append(("response_format", c))
        if self.guided_json is not None:
            found.append(("guided_json", _guided_json(self.guided_json)))
        if self.guided_regex is not None:
            found.append(("guided_regex", Constraint("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", Constraint("choice", json.dumps(self.guided_choice))))
        if len(found) > 1:
            msg = f"{found[0][0]} and {found[1][0]} both constrain the output: give at most one"
            raise ApiError(400, msg, param=found[1][0])
        return found[0] if found else None

    def _sampling(
        self, max_new_tokens: int, vocab_size: int, constraint: Constraint | None
    ) -> SamplingParams:
        """What both endpoints ask alike; the endpoint's own fields come on top."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=stop,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=logit_bias_ids((self.logit_bias or {}).items(), vocab_size),
            constraint=constraint,
        )

    def _checked(self, sp: SamplingParams, names: Mapping[str, str]) -> SamplingParams:
        """``sp`` validated, a failure a 400 naming this request's field (``names``: SamplingParams'
        names where the request's differ)."""
        try:
            sp.validate()
        except SamplingError as e:
            raise ApiError(400, str(e), param=names.get(e.param, e.param)) from e
        return sp


# -------------------------------------------------------------------------------- completions
class CompletionRequest(_Sampling):
    prompt: (
        Text
        | Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
        | list[TokenId]
        | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: Text | None = None

    def _optional_features(self) -> list[tuple[str, object, tuple[object, ...]]]:
        return [("best_of", self.best_of, (None, self.n)), ("suffix", self.suffix or None, (None,))]

    def sampling_params(self, vocab_size: int, source: Source | None) -> SamplingParams:
        """This request's SamplingParams (raises ApiError naming the field); ``source``: its
        ``constraint()``, computed once by the caller (which also checks it compiles)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        if max_tokens < 1 and not (max_tokens == 0 and self.echo):
            msg = f"max_tokens must be at least 1 (0 only with echo: true), got {max_tokens}"
            raise ApiError(400, msg, param="max_tokens")
        sp = self._sampling(max_tokens, vocab_size, source[1] if source else None)
        sp.logprobs = self.logprobs
        if self.echo and (self.logprobs is not None or max_tokens == 0):
            # The prompt's own scores come with its echo. max_tokens 0 generates nothing, which only
            # prompt scoring asks for: the scores are then computed even if not shown.
            sp.prompt_logprobs = self.logprobs if self.logprobs is not None else 0
        names = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}
        return self._checked(sp, {**names, "constraint": source[0] if source else "response_format"})


# ----------------------------------------------------------------------------------------- chat
class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Name
    arguments: Text  # JSON text, as the model wrote it


class MessageToolCall(_Strict):
    id: Name
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Name | None = None  # tool: the call this message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def openai_dict(self) -> dict[str, object]:
        """The message as OpenAI's plain shape (content parts joined; unset fields left out), what
        tool_calls.template_messages turns into the chat template's."""
        out = self.model_dump(exclude_none=True, by_alias=True)
        if self.content is not None:
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
        names = {"max_new_tokens": tokens_field, "logprobs": "top_logprobs"}
        return self._checked(sp, {**names, "constraint": source[0] if source else "response_format"})


def logit_bias_ids(bias: Iterable[tuple[str | int, float]], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as token ids of this model's vocabulary, else a 400: the one check for HTTP (keys
    are OpenAI's digit strings) and gRPC (ints; SamplingParams.validate bounds only their range)."""
    out = []
    for key, value in bias:
        token = key if isinstance(key, int) else int(key) if re.fullmatch(r"[0-9]{1,10}", key) else -1
        if not 0 <= token < vocab_size:
            msg = f"logit_bias keys must be token ids of this model (0..{vocab_size - 1}), got {key!r}"
            raise ApiError(400, msg, param="logit_bias")
        out.append((token, value))
    return tuple(out)


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


# --------------------------------------------------------------------------------------- errors
def validation_message(errors: Sequence[Mapping[str, object]]) -> tuple[str, str | None]:
    """A pydantic error list as one message a client can act on, and the offending field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg')}", None
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    if extra:  # a field we do not know or do not implement: say so by name, not as a type error
        where = _where(extra[0])
        return f"{where}: this field is not supported by this server", where
    msgs = "; ".join(f"{_where(e)}: {e.get('msg')}" for e in errors[:3])
    return msgs, _where(first)


def _where(e: Mapping[str, object]) -> str:
    # Union branches appear in the location as their type ("str", "list[int]", a model's class
    # name, response_format's tags): not a field name.
    loc = e.get("loc", ())
    parts = [
        str(x)
        for x in (loc if isinstance(loc, (list, tuple)) else ())
        if x != "body" and not (isinstance(x, str) and ("[" in x or x in _TYPES or x[:1].isupper()))
    ]
    return ".".join(parts) or "body"


_TYPES = {"str", "int", "float", "bool"}
