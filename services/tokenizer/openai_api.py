"""OpenAI-compatible request schemas and response bodies (pure: no I/O).

One schema per endpoint, strict and bounded, so bad input is a 400 that names the field, never a
500 further in:
- types are strict (a string where a number belongs is a 400, not a coercion); NaN and Infinity
  are refused; integers are bounded to what the gRPC contract carries (token ids and lengths int32,
  seeds int64); strings must be valid Unicode (no lone surrogates);
- ranges are SamplingParams.validate's, the one check the gRPC front door and the Engine share;
- fields OpenAI documents that radixserve does not implement are accepted only at their neutral
  value (``presence_penalty: 0``, ``logprobs: null``, ...) and refused with a 400 naming them
  otherwise (``unsupported``); ``user`` is accepted and ignored on purpose (it labels requests for
  the provider's abuse monitoring); any other field is refused as unknown.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, TypedDict

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from radixserve.common.sampling import MAX_TOKENS, SEED_BITS, SamplingParams

MAX_N = 16
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_MESSAGES = 4096
MAX_LOGPROBS = 20

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (gRPC Generate: the same)


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone UTF-16 surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


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
    # Documented by OpenAI (or vLLM), not implemented yet: only their neutral values pass.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, object] | None = None

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
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
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to something this server does not do: (field, message)."""
        for name, value, neutral in self._optional_features():
            if value not in neutral:
                return name, f"{name}={value!r} is not supported by this server (only {neutral[0]!r})"
        return None

    def _optional_features(self) -> list[tuple[str, object, tuple[object, ...]]]:
        rf = self.response_format
        return [
            ("presence_penalty", self.presence_penalty, (0.0,)),
            ("frequency_penalty", self.frequency_penalty, (0.0,)),
            ("repetition_penalty", self.repetition_penalty, (1.0,)),
            ("logit_bias", self.logit_bias or None, (None,)),
            (
                "response_format",
                None if rf is None or rf == {"type": "text"} else rf,
                (None, {"type": "text"}),
            ),
        ]


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
        return [
            *super()._optional_features(),
            ("echo", self.echo, (False,)),
            ("logprobs", self.logprobs, (None,)),
            ("best_of", self.best_of, (None, self.n)),
            ("suffix", self.suffix or None, (None,)),
        ]


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(le=MAX_TOKENS)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: Text | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None

    def _optional_features(self) -> list[tuple[str, object, tuple[object, ...]]]:
        return [
            *super()._optional_features(),
            ("logprobs", self.logprobs, (None, False)),
            ("top_logprobs", self.top_logprobs, (None, 0)),
            ("tools", self.tools or None, (None,)),
            ("tool_choice", self.tool_choice, (None, "none", "auto")),
        ]


# ---------------------------------------------------------------------------------- responses
class CachedTokens(TypedDict):
    cached_tokens: int


class UsageBody(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class AssistantMessage(TypedDict, total=False):
    role: str
    content: str


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str | None


class ChatDeltaChoice(TypedDict):
    index: int
    delta: AssistantMessage
    logprobs: None
    finish_reason: str | None


class _Body(TypedDict):
    id: str
    object: str
    created: int
    model: str
    choices: Sequence[CompletionChoice | ChatChoice | ChatDeltaChoice]


class Body(_Body, total=False):
    """A response, or a chunk of a streamed one (chunks have ``usage`` with include_usage only)."""

    usage: UsageBody | None


@dataclass(frozen=True, slots=True)
class ChoiceText:
    """A finished choice of a non-streamed response."""

    index: int
    text: str
    finish_reason: str | None


def response_id(rid: str, chat: bool) -> str:
    """The OpenAI id of request ``rid``'s response (and of each chunk of it): the request's own id."""
    return f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"


def usage(prompt: int, completion: int, cached: int) -> UsageBody:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_body(rid: str, model: str, choices: Sequence[ChoiceText], use: UsageBody) -> Body:
    return {
        "id": response_id(rid, chat=False),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            for c in choices
        ],
        "usage": use,
    }


def chat_body(rid: str, model: str, choices: Sequence[ChoiceText], use: UsageBody) -> Body:
    return {
        "id": response_id(rid, chat=True),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": use,
    }


def completion_chunk(
    rid: str, model: str, created: int, index: int, text: str, finish_reason: str | None
) -> Body:
    return {
        "id": response_id(rid, chat=False),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunk(
    rid: str, model: str, created: int, index: int, delta: AssistantMessage, finish_reason: str | None
) -> Body:
    return {
        "id": response_id(rid, chat=True),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, model: str, created: int, chat: bool, use: UsageBody) -> Body:
    """The last chunk of a stream with include_usage: no choices, the request's usage."""
    return {
        "id": response_id(rid, chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }


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
    # union branches appear in the location as their type ("str", "list[int]"): not a field name
    loc = e.get("loc", ())
    parts = [
        str(x)
        for x in (loc if isinstance(loc, (list, tuple)) else ())
        if x != "body" and not (isinstance(x, str) and ("[" in x or x in _TYPES))
    ]
    return ".".join(parts) or "body"


_TYPES = {"str", "int", "float", "bool"}
