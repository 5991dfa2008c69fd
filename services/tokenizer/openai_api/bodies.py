"""OpenAI response bodies and chunks, and their logprobs (pure: no I/O).

Logprobs come from the detokenizer aligned with a delivery's token ids (pb.Logprobs: one logprob per
token, NaN where there is none, and each token's alternatives, most likely first). Their JSON never
holds NaN or Infinity (not JSON): a missing score is null, and -inf (a token the model rules out
entirely) is OpenAI's floor for the practically impossible, -9999.0.

- ``/v1/completions``: OpenAI's legacy object ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``. Each ``top_logprobs`` entry maps the k most likely tokens' texts to their
  logprobs *plus the chosen token's* (OpenAI documents up to logprobs + 1 entries; vLLM does the
  same), so ``logprobs: 0`` gives the chosen token alone and a scorer can tell whether the chosen
  token was the most likely (lm-eval's is_greedy). The prompt's first token (echo) has neither: null.
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``
  with exactly ``top_logprobs`` alternatives, as OpenAI's chat API.
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

from radixserve.common.rpc import pb

IMPOSSIBLE = -9999.0  # OpenAI's logprob for a token with (practically) no chance


class Pieces(Protocol):
    """(shown text, raw bytes) of a token: token_pieces.TokenPieces."""

    def piece(self, token_id: int) -> tuple[str, bytes]: ...


# ------------------------------------------------------------------------------------ logprobs
@dataclass(frozen=True, slots=True)
class Scored:
    """One token with its logprob (None: none, a prompt's first) and its alternatives."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def scored(token_ids: Sequence[int], lp: pb.Logprobs) -> list[Scored]:
    """A delivery's tokens with their scores (a token the scores do not reach has none)."""
    out = []
    for i, tid in enumerate(token_ids):
        value = lp.logprob[i] if i < len(lp.logprob) else math.nan
        top = lp.top[i] if i < len(lp.top) else None
        alts = tuple(zip(top.token_ids, top.logprobs, strict=False)) if top is not None else ()
        out.append(Scored(tid, None if math.isnan(value) else value, alts))
    return out


def number(x: float) -> float | None:
    """A logprob as JSON can carry it."""
    if math.isnan(x):
        return None
    return IMPOSSIBLE if x == -math.inf else x


class TextOffsets:
    """Where each token starts in a text, in characters: its bytes go through one UTF-8 decoder, so a
    character split over two tokens is counted once, at the token where it starts."""

    def __init__(self, start: int = 0) -> None:
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, raw: bytes) -> int:
        at = self.at
        self.at += len(self._decoder.decode(raw))
        return at


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


def no_completion_logprobs() -> CompletionLogprobs:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def completion_logprobs(tokens: Sequence[Scored], pieces: Pieces, offsets: TextOffsets) -> CompletionLogprobs:
    out = no_completion_logprobs()
    for t in tokens:
        text, raw = pieces.piece(t.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if t.logprob is None else number(t.logprob))
        out["top_logprobs"].append(_top_dict(t, text, pieces))
        out["text_offset"].append(offsets.take(raw))
    return out


def _top_dict(t: Scored, text: str, pieces: Pieces) -> dict[str, float | None] | None:
    if t.logprob is None:
        return None
    top: dict[str, float | None] = {}
    for tid, lp in t.top:  # two ids may show the same text: the more likely one's score stays
        top.setdefault(pieces.piece(tid)[0], number(lp))
    top.setdefault(text, number(t.logprob))
    return top


def extend_completion_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into["tokens"].extend(more["tokens"])
    into["token_logprobs"].extend(more["token_logprobs"])
    into["top_logprobs"].extend(more["top_logprobs"])
    into["text_offset"].extend(more["text_offset"])


class TopLogprob(TypedDict):
    token: str
    logprob: float | None
    bytes: list[int]


class ContentLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ContentLogprob] | None
    refusal: None


def chat_logprobs(tokens: Sequence[Scored], pieces: Pieces) -> list[ContentLogprob]:
    out: list[ContentLogprob] = []
    for t in tokens:
        text, raw = pieces.piece(t.token_id)
        top: list[TopLogprob] = []
        for tid, lp in t.top:
            alt_text, alt_raw = pieces.piece(tid)
            top.append({"token": alt_text, "logprob": number(lp), "bytes": list(alt_raw)})
        logprob = None if t.logprob is None else number(t.logprob)
        out.append({"token": text, "logprob": logprob, "bytes": list(raw), "top_logprobs": top})
    return out


# ---------------------------------------------------------------------------------- tool calls
class FunctionBody(TypedDict):
    name: str
    arguments: str


class ToolCallBody(TypedDict):
    id: str
    type: str
    function: FunctionBody


class FunctionDeltaBody(TypedDict, total=False):
    name: str
    arguments: str


class ToolCallDeltaBody(TypedDict, total=False):
    """A streamed piece of a tool call: ``id``, ``type`` and the name only in a call's first."""

    index: int
    id: str
    type: str
    function: FunctionDeltaBody


# ------------------------------------------------------------------------------------- bodies
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
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class AssistantMessage(TypedDict, total=False):
    role: str
    content: str | None
    reasoning_content: str | None  # with --reasoning-parser (vLLM's and SGLang's field)
    tool_calls: list[ToolCallBody]


class ChatDelta(TypedDict, total=False):
    role: str
    content: str
    reasoning_content: str
    tool_calls: list[ToolCallDeltaBody]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatDeltaChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
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


@dataclass(slots=True)
class CompletionResult:
    """A finished choice of a non-streamed completion."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


@dataclass(slots=True)
class ChatResult:
    """A finished choice of a non-streamed chat completion."""

    index: int
    content: str | None
    finish_reason: str | None
    tool_calls: list[ToolCallBody] = field(default_factory=list)
    logprobs: list[ContentLogprob] | None = None
    reasoning: str | None = None  # with --reasoning-parser


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


def _chat_lp(content: list[ContentLogprob] | None) -> ChatLogprobs | None:
    return None if content is None else {"content": content, "refusal": None}


def _envelope(
    rid: str,
    chat: bool,
    kind: str,
    created: int,
    model: str,
    choices: Sequence[CompletionChoice | ChatChoice | ChatDeltaChoice],
    use: UsageBody | None = None,
) -> Body:
    """What every response and chunk carries around its choices (``usage`` only where given)."""
    body: Body = {
        "id": response_id(rid, chat),
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body


def completion_body(rid: str, model: str, choices: Sequence[CompletionResult], use: UsageBody) -> Body:
    bodies: list[CompletionChoice] = [
        {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        for c in choices
    ]
    return _envelope(rid, False, "text_completion", int(time.time()), model, bodies, use)


def _message(c: ChatResult) -> AssistantMessage:
    message: AssistantMessage = {"role": "assistant", "content": c.content}
    if c.reasoning is not None:
        message["reasoning_content"] = c.reasoning
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    return message


def chat_body(rid: str, model: str, choices: Sequence[ChatResult], use: UsageBody) -> Body:
    bodies: list[ChatChoice] = [
        {
            "index": c.index,
            "message": _message(c),
            "logprobs": _chat_lp(c.logprobs),
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    return _envelope(rid, True, "chat.completion", int(time.time()), model, bodies, use)


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: CompletionLogprobs | None = None,
) -> Body:
    choice: CompletionChoice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    return _envelope(rid, False, "text_completion", created, model, [choice])


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    index: int,
    delta: ChatDelta,
    finish_reason: str | None,
    logprobs: list[ContentLogprob] | None = None,
) -> Body:
    choice: ChatDeltaChoice = {
        "index": index,
        "delta": delta,
        "logprobs": _chat_lp(logprobs),
        "finish_reason": finish_reason,
    }
    return _envelope(rid, True, "chat.completion.chunk", created, model, [choice])


def usage_chunk(rid: str, model: str, created: int, chat: bool, use: UsageBody) -> Body:
    """The last chunk of a stream with include_usage: no choices, the request's usage."""
    return _envelope(
        rid, chat, "chat.completion.chunk" if chat else "text_completion", created, model, [], use
    )
