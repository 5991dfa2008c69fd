"""Sampling parameters: what a request asks of the sampler and of the stop logic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The ranges every front door (HTTP, gRPC, the offline Engine) enforces: OpenAI's where it documents
# one (temperature in [0, 2]), vLLM's otherwise.
MAX_TEMPERATURE = 2.0
# OpenAI allows 4; evaluation harnesses send more (lm-eval appends the EOS text to a task's stop list).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_TOKENS = 2**31 - 1  # what fits the gRPC contract's int32; the context is checked later
SEED_BITS = 64  # a signed 64-bit seed (the gRPC contract's int64)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's bound for top_logprobs)
MAX_PENALTY = 2.0  # presence/frequency: OpenAI's [-2, 2]
MAX_REPETITION_PENALTY = 2.0  # HF's multiplicative penalty, in (0, 2] (SGLang's bound)
MAX_LOGIT_BIAS = 100.0  # OpenAI's [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_CONSTRAINT_CHARS = 1 << 20  # a JSON schema / regex / grammar's text
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "lark", "llguidance")


class SamplingError(ValueError):
    """A sampling parameter out of range; ``param`` names it (SamplingParams' field name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Constraint:
    """Structured output: the tokens a request may produce, enforced by masking logits each step
    (scheduler/grammar.py).

    ``kind`` / ``spec``: ``json_object`` (spec ignored: any JSON object), ``json_schema`` (spec: the
    schema as JSON text), ``regex`` (spec: the pattern the whole output matches), ``choice`` (spec: a
    JSON list of strings, the output is one of them), ``lark`` (spec: an llguidance Lark grammar; the
    gateway's tool calls build these), ``llguidance`` (spec: llguidance's own grammar JSON, several
    grammars referring to each other; the gateway's answer-after-reasoning builds these)."""

    kind: str
    spec: str = ""


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (checked on text, not tokens)
    ignore_eos: bool = False
    # OpenAI's presence/frequency penalties (over the generated tokens) and HF's repetition penalty
    # (over prompt and generated tokens); applied on the device (scheduler/model/penalties.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, added to its logit)
    # Log-probabilities: None asks for none; k >= 0 asks for each token's own and its k most likely
    # alternatives'. ``prompt_logprobs`` scores the prompt's tokens too (completions' echo).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    # vLLM's min_tokens: no EOS, stop token (masked on the device) or stop string (not matched by the
    # detokenizer) before this many tokens.
    min_new_tokens: int = 0
    # vLLM's include_stop_str_in_output: a matched stop string stays at the end of the text.
    include_stop_str: bool = False

    def validate(self) -> None:
        """Raise SamplingError with a message a client can act on."""
        mt = self.max_new_tokens
        # 0 only to score a prompt (completions' echo with max_tokens 0): nothing is generated.
        least = 0 if self.prompt_logprobs is not None else 1
        if isinstance(mt, bool) or not isinstance(mt, int) or not least <= mt <= MAX_TOKENS:
            raise SamplingError(
                "max_new_tokens",
                f"max_new_tokens must be a positive integer (at most {MAX_TOKENS}), got {mt!r}"
                if least
                else f"max_new_tokens must be an integer in [0, {MAX_TOKENS}], got {mt!r}",
            )
        _in_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _in_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or self.top_k == 0
            or not -1 <= self.top_k <= MAX_TOKENS
        ):
            raise SamplingError("top_k", f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        _in_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -(2 ** (SEED_BITS - 1)) <= self.seed < 2 ** (SEED_BITS - 1)
        ):
            raise SamplingError("seed", f"seed must be a {SEED_BITS}-bit signed integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(
                "stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        for x in self.stop:
            if not isinstance(x, str) or not 1 <= len(x) <= MAX_STOP_CHARS:
                raise SamplingError(
                    "stop", f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if any(not 0 <= t <= MAX_TOKENS for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids", "stop_token_ids must be token ids (integers >= 0)")
        mn = self.min_new_tokens
        if isinstance(mn, bool) or not isinstance(mn, int) or not 0 <= mn <= mt:
            raise SamplingError(
                "min_new_tokens", f"min_new_tokens must be an integer in [0, max_new_tokens={mt}], got {mn!r}"
            )
        self._validate_extras()

    def _validate_extras(self) -> None:
        """Penalties, logit bias, logprobs and the structured-output constraint."""
        mt = self.max_new_tokens
        _in_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _in_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _in_range("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise SamplingError("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        bias = []
        for item in self.logit_bias:
            tok, value = item
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok <= MAX_TOKENS:
                raise SamplingError("logit_bias", f"logit_bias keys must be token ids, got {tok!r}")
            _in_range("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            bias.append((tok, float(value)))
        self.logit_bias = tuple(bias)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (
                isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS
            ):
                raise SamplingError(name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        c = self.constraint
        if c is not None:
            if c.kind not in CONSTRAINT_KINDS:
                raise SamplingError(
                    "constraint", f"constraint kind must be one of {CONSTRAINT_KINDS}, got {c.kind!r}"
                )
            if not isinstance(c.spec, str) or len(c.spec) > MAX_CONSTRAINT_CHARS:
                raise SamplingError(
                    "constraint", f"a constraint's spec is text of at most {MAX_CONSTRAINT_CHARS} characters"
                )
            if self.ignore_eos:
                raise SamplingError(
                    "ignore_eos", "ignore_eos cannot be combined with a structured-output constraint"
                )
            if mt == 0:
                raise SamplingError(
                    "max_new_tokens", "a structured-output constraint needs max_new_tokens >= 1"
                )
            if self.min_new_tokens:  # the grammar may have to end the output before it
                raise SamplingError(
                    "min_new_tokens", "min_new_tokens cannot be combined with a structured-output constraint"
                )

    @property
    def penalized(self) -> bool:
        """Whether the sampler must adjust this request's logits (penalties or a logit bias)."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        """Presence, frequency or repetition penalty on (the ones that need token counts)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _in_range(name: str, value: object, lo: float, hi: float, low_open: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (lo < value if low_open else lo <= value)
        and value <= hi  # NaN fails
    )
    if not ok:
        raise SamplingError(
            name, f"{name} must be a number in {'(' if low_open else '['}{lo:g}, {hi:g}], got {value!r}"
        )


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The earliest stop string in ``text[start:]``: (where it starts, which), or (-1, "").

    The one stop-string search: the detokenizer (streaming) and the offline Engine both cut here."""
    best, which = -1, ""
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, s
    return best, which


def stop_in_output(tokenizer: Any, ids: list[int], sp: SamplingParams) -> tuple[int, str]:
    """Where the first stop string starts in the decoded ``ids`` and which, as the detokenizer finds
    it: only in text after the first ``min_new_tokens`` tokens' (a match may begin inside them)."""
    if not sp.stop:
        return -1, ""
    text = str(tokenizer.decode(ids, skip_special_tokens=True))
    if len(ids) <= sp.min_new_tokens:
        return -1, ""
    # the detokenizer looks from one stop length before the text of the first token past the minimum
    head = str(tokenizer.decode(ids[: sp.min_new_tokens], skip_special_tokens=True))
    start = max(0, len(head) - max(map(len, sp.stop)) + 1) if sp.min_new_tokens else 0
    return find_stop(text, sp.stop, start)
