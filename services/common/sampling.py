"""Sampling parameters: what a request asks of the sampler and of the stop logic."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def validate(self) -> None:
        """Raise ValueError with a message a client can act on."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise ValueError("stop must be a non-empty string or a list of them")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The earliest stop string in ``text[start:]``: (where it starts, which), or (-1, "").

    The one stop-string search: the detokenizer (streaming) and the offline Engine both cut here."""
    best, which = -1, ""
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, s
    return best, which
