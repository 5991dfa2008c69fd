"""Repetition penalties on the device, with each request's token counts kept there incrementally.

Definitions (what clients expect from the names):

- ``frequency_penalty`` / ``presence_penalty`` (OpenAI):
  ``logit -= frequency * count + presence * (count > 0)``, ``count`` being how often the token
  occurs in the request's *generated* tokens;
- ``repetition_penalty`` (HF ``RepetitionPenaltyLogitsProcessor``): a token that occurs in the prompt or the
  generated tokens gets ``logit / p`` when its logit is positive and ``logit * p`` otherwise.

State: ``counts[row, token]`` (int32, generated tokens) and ``in_prompt[row, token]`` (bool), one row per
``ReqToTokenPool`` row, allocated on first use (a server whose clients never ask pays nothing). A step
adds its sampled tokens to the counts on the device, in stream order, so the overlap loop's next batch
(launched before this one's tokens reach the host) reads counts that already include them. A row is
rebuilt from the host's tokens only when a request (re)starts sampling on it: its first sample after
admission or after a retraction, whose dropped tokens the device counted but the request will redo.
At Qwen3's vocabulary (151,936) each row holds 0.76 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PenaltyStep:
    """One step's penalised rows, as device tensors (built on the scheduler thread)."""

    rows: torch.Tensor  # [P] int64: rows of the step's logits
    slots: torch.Tensor  # [P] int64: their rows in the count tables (ReqToTokenPool rows)
    params: torch.Tensor  # [P, 3] float32: frequency, presence, repetition
    # Rows to rebuild before this step: (slot, prompt token ids, generated token ids so far).
    resets: list[tuple[int, torch.Tensor, torch.Tensor]]


class PenaltyState:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None

    @staticmethod
    def table_bytes(num_slots: int, vocab_size: int) -> int:
        """Device memory the tables take once used (the engine keeps it out of the KV pool)."""
        return num_slots * vocab_size * (4 + 1)  # int32 counts + bool prompt flags

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None or self.in_prompt is None:
            shape = (self.num_slots, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.counts, self.in_prompt

    def apply(self, logits: torch.Tensor, step: PenaltyStep) -> None:
        """Penalise ``step.rows`` of ``logits`` [B, V] (float32) in place."""
        counts, in_prompt = self._tables()
        for slot, prompt, generated in step.resets:
            counts[slot].zero_()
            counts[slot].index_add_(0, generated, torch.ones_like(generated, dtype=torch.int32))
            in_prompt[slot].zero_()
            in_prompt[slot].index_fill_(0, prompt, True)
        c = counts.index_select(0, step.slots)
        x = logits.index_select(0, step.rows)
        freq, presence, rep = step.params.unbind(1)
        seen = c > 0
        # HF applies the repetition penalty to the raw logits, then the additive ones (vLLM's order too).
        rep = rep.unsqueeze(1)
        penalised = torch.where(x > 0, x / rep, x * rep)
        x = torch.where(seen | in_prompt.index_select(0, step.slots), penalised, x)
        x = x - c.to(x.dtype) * freq.unsqueeze(1) - seen.to(x.dtype) * presence.unsqueeze(1)
        logits.index_copy_(0, step.rows, x)

    def count(self, step: PenaltyStep, tokens: torch.Tensor) -> None:
        """Add the step's sampled tokens (``tokens`` [B], int64) to their rows' counts."""
        counts, _ = self._tables()
        sampled = tokens.index_select(0, step.rows)
        counts.index_put_((step.slots, sampled), torch.ones_like(sampled, dtype=torch.int32), accumulate=True)
