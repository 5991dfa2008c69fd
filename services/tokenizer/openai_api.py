"""OpenAI-compatible request schemas and response bodies (pure: no I/O).

Requests are validated strictly (a string where a number belongs is a 400, not a coercion);
fields OpenAI defines that radixserve does not use are accepted and ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.common.sampling import SamplingParams

MAX_N = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None

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


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_body(
    rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": c["index"], "text": c["text"], "logprobs": None, "finish_reason": c["finish_reason"]}
            for c in choices
        ],
        "usage": use,
    }


def chat_body(rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c["index"],
                "message": {"role": "assistant", "content": c["text"]},
                "logprobs": None,
                "finish_reason": c["finish_reason"],
            }
            for c in choices
        ],
        "usage": use,
    }


def completion_chunk(
    rid: str, model: str, created: int, index: int, text: str, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_chunk(
    rid: str, model: str, created: int, index: int, delta: dict[str, str], finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A pydantic error list as one message a client can act on, and the offending field."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg')}", None
    where = ".".join(loc) or "body"
    msgs = "; ".join(
        f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
        for e in errors[:3]
    )
    return msgs, where
