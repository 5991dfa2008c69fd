"""OpenAI-compatible request schemas and their SamplingParams (pure: no I/O). The response bodies are
bodies.py's.

One schema per endpoint, strict and bounded, so bad input is a 400 that names the field, never a
500 further in:
- types are strict (a string where a number belongs is a 400, not a coercion); NaN and Infinity
  are refused; integers are bounded to what the gRPC contract carries (token ids and lengths int32,
  seeds int64); strings must be valid Unicode (no lone surrogates);
- ranges are SamplingParams.validate's, the one check the gRPC front door and the Engine share (its
  parameter names are mapped back to the request's own: ``max_new_tokens`` is ``max_tokens``, ...);
- structured output comes from one source per request: OpenAI's ``response_format``, vLLM's
  ``guided_json`` / ``guided_regex`` / ``guided_choice``, or a chat's forcing ``tool_choice``;
- what each field does, or why it is accepted and ignored, or refused at any value but a neutral
  one, is fields.FIELDS' (the one table; fields.refused applies it); a field in no
  row is refused as unknown, by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

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
from radixserve.tokenizer.text.tool_grammar import FUNCTION_NAME

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
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk
    include_obfuscation: Any = None  # ignored (fields.py)


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


def _guided_json(value: JsonObject | str, field: str = "guided_json") -> Constraint:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too (SGLang's json_schema only so)
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"{field} is not valid JSON: {e}", param=field) from None
        if not isinstance(parsed, dict):
            raise ApiError(400, f"{field} must be a JSON schema (an object)", param=field)
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
    # vLLM's extensions for structured output, and SGLang's names for two of them.
    guided_json: JsonObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Choices | None = None
    json_schema: Text | None = None
    regex: Text | None = None
    # vLLM's and SGLang's sampling and text extensions.
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True  # ignored: fast tokenizers put no spaces there
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] | None = None
    add_special_tokens: bool | None = None  # None: the endpoint's default
    # Accepted and ignored, or refused unless neutral: fields.FIELDS says which and why.
    guided_decoding_backend: Any = None
    priority: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    extra_key: Any = None
    custom_labels: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    ebnf: Any = None
    structured_outputs: Any = None
    request_id: Any = None
    rid: Any = None
    cache_salt: Any = None
    prompt_logprobs: Any = None
    return_tokens_as_token_ids: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    lora_path: Any = None
    session_id: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    custom_params: Any = None
    stop_regex: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    routed_experts_start_len: Any = None
    return_cached_tokens_details: Any = None
    return_token_ids: Any = None
    images_config: Any = None
    ngram_corpus_id: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def truncated(self, ids: list[int], context: int | None) -> list[int]:
        """``ids`` cut to their last ``truncate_prompt_tokens`` (-1: the context length), vLLM's rule."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            if context is None:
                return ids
            k = context
        if k == 0:
            raise ApiError(
                400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens"
            )
        return ids[-k:]

    def check_stream_options(self) -> None:
        """vLLM's rule: stream_options only with stream (a non-streamed body has its usage anyway)."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

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
        if self.json_schema is not None:
            found.append(("json_schema", _guided_json(self.json_schema, "json_schema")))
        if self.regex is not None:
            found.append(("regex", Constraint("regex", self.regex)))
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
            min_new_tokens=self.min_tokens,
            include_stop_str=self.include_stop_str_in_output or self.no_stop_trim,
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
        names = {
            "max_new_tokens": "max_tokens",
            "prompt_logprobs": "logprobs",
            "min_new_tokens": "min_tokens",
        }
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
    # A union's branches each report: the error deepest in the body says the most (``input.0.role``
    # rather than ``input``, which was not a string either).
    deepest = sorted(errors, key=lambda e: -len(_where(e).split(".")))
    msgs = "; ".join(f"{_where(e)}: {e.get('msg')}" for e in deepest[:3])
    return msgs, _where(deepest[0])


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
