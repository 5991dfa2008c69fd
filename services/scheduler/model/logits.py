"""Between the model and the sampler: what a step does to its logits for the requests that ask.

In this order, on the device:

1. log-probabilities of the *raw* logits (``log_softmax`` before any of the below) for the rows whose
   request asked (``SamplingParams.logprobs``), and for the prompt positions of requests scoring their
   prompt (``prompt_logprobs``: the model computed logits there too, ``ScoreLayout.prompt_index``);
2. ``logit_bias``: added to the named tokens' logits;
3. penalties (penalties.py);
4. the structured-output mask (grammar.py): disallowed tokens get ``-inf``;
5. the sampler, then the sampled tokens are added to the penalty counts.

A batch that asks for none of it plans nothing (``LogitsProcessor.plan`` returns None): its step runs
model -> sampler exactly as before, with no extra copy or kernel.

Why raw logits for logprobs: a client scoring text (evaluation harnesses, classifiers) wants the
model's distribution, not one reshaped by its own sampling settings. vLLM does the same by default
(``logprobs_mode="raw_logprobs"``); SGLang and OpenAI return the distribution after temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from radixserve.scheduler.batch import ForwardMode, ScheduleBatch, ScoreLayout
from radixserve.scheduler.grammar import allocate_bitmask, apply_bitmask
from radixserve.scheduler.model.penalties import PenaltyState, PenaltyStep
from radixserve.scheduler.model.sampler import Sampler, SamplingInfo
from radixserve.scheduler.model.staging import to_device


@dataclass(slots=True)
class LogitsStep:
    """One step's logits work, built on the scheduler thread; None fields are skipped."""

    layout: ScoreLayout | None
    logprob_rows: torch.Tensor | None  # [R] int64: rows of the logits whose sampled token is scored
    prompt_targets: torch.Tensor | None  # [E] int64: the prompt token each extra logits row scores
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    penalties: PenaltyStep | None
    bitmask: torch.Tensor | None  # [B, W] int32 (grammar.mask_width): bit 0 = the token is refused


@dataclass(slots=True)
class StepScores:
    """A step's log-probabilities: for ``layout.rows`` (``token_*``, ``top_*``) and ``layout.prompt``
    (``prompt_*``); device tensors from ``LogitsProcessor.sample``, host ones after ``to_host``."""

    token: torch.Tensor  # [R] float32
    top_ids: torch.Tensor  # [R, K] int64
    top: torch.Tensor  # [R, K] float32
    prompt: torch.Tensor  # [E] float32
    prompt_top_ids: torch.Tensor  # [E, K'] int64
    prompt_top: torch.Tensor  # [E, K'] float32

    def to_host(self, non_blocking: bool = False) -> StepScores:
        moved = [getattr(self, f.name).to("cpu", non_blocking=non_blocking) for f in fields(self)]
        return StepScores(*moved)


class LogitsProcessor:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        """``num_slots``: rows of the ReqToTokenPool (a request's row keys its penalty counts)."""
        self.device = device
        self.vocab_size = vocab_size
        self.penalties = PenaltyState(num_slots, vocab_size, device)

    # --------------------------------------------------------------------- host (scheduler thread)
    def plan(self, batch: ScheduleBatch) -> LogitsStep | None:
        layout = batch.scores
        sampled = batch.token_index >= 0  # rows that sample a token this step (not a prefill chunk)
        extend = batch.mode is ForwardMode.EXTEND
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        pen_rows: list[int] = []
        pen_slots: list[int] = []
        pen_params: list[tuple[float, float, float]] = []
        resets: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        constrained: list[int] = []
        for i, r in enumerate(batch.reqs):
            sp = r.sampling
            if not sampled[i] or (not sp.penalized and r.grammar is None):
                continue
            if r.grammar is not None:
                constrained.append(i)
            for tok, value in sp.logit_bias:
                if tok < self.vocab_size:
                    bias_rows.append(i)
                    bias_ids.append(tok)
                    bias_values.append(value)
            if sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0:
                assert r.req_pool_idx is not None
                pen_rows.append(i)
                pen_slots.append(r.req_pool_idx)
                pen_params.append((sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty))
                if extend:
                    # Its first sample on this row (after admission or a retraction): rebuild the row
                    # from the tokens known here; from now on the device counts each step's token.
                    known = np.asarray(r.output_ids[: int(batch.token_index[i])], dtype=np.int64)
                    resets.append((r.req_pool_idx, self._ids(r.origin_ids), self._ids(known)))
        if layout is None and not bias_rows and not pen_rows and not constrained:
            return None
        bitmask = None
        if constrained:
            host = allocate_bitmask(batch.size, self.vocab_size)
            for i in constrained:
                grammar = batch.reqs[i].grammar
                assert grammar is not None
                grammar.fill_mask(host, i)
            bitmask = to_device(host, self.device)[1]
        return LogitsStep(
            layout=layout,
            logprob_rows=self._ids(layout.rows) if layout is not None and layout.rows else None,
            prompt_targets=self._prompt_targets(batch, layout),
            bias=(self._ids(bias_rows), self._ids(bias_ids), self._floats(bias_values))
            if bias_rows
            else None,
            penalties=PenaltyStep(self._ids(pen_rows), self._ids(pen_slots), self._floats(pen_params), resets)
            if pen_rows
            else None,
            bitmask=bitmask,
        )

    def _prompt_targets(self, batch: ScheduleBatch, layout: ScoreLayout | None) -> torch.Tensor | None:
        if layout is None or not layout.prompt:
            return None
        reqs = batch.reqs
        return self._ids([int(reqs[row].origin_ids[pos]) for row, pos in layout.prompt])

    def _ids(self, values: object) -> torch.Tensor:
        return to_device(torch.as_tensor(np.asarray(values, dtype=np.int64)), self.device)[1]

    def _floats(self, values: object) -> torch.Tensor:
        return to_device(torch.as_tensor(np.asarray(values, dtype=np.float32)), self.device)[1]

    # ---------------------------------------------------------------------------- device stream
    def sample(
        self, logits: torch.Tensor, info: SamplingInfo, step: LogitsStep, sampler: Sampler
    ) -> tuple[torch.Tensor, StepScores | None]:
        """``logits`` [B (+E), V]: each request's last position, then the extra prompt positions of
        ``step.layout``. Returns the sampled tokens [B] and the step's scores (None when none asked)."""
        n = len(info)
        prompt_logits = logits[n:]
        logits = logits[:n]
        raw = None
        if step.logprob_rows is not None:
            raw = torch.log_softmax(logits.index_select(0, step.logprob_rows).float(), dim=-1)
        if step.bias is not None or step.penalties is not None or step.bitmask is not None:
            logits = logits.float().clone()  # the model's output may be a captured graph's buffer
            if step.bias is not None:
                rows, ids, values = step.bias
                logits.index_put_((rows, ids), values, accumulate=True)
            if step.penalties is not None:
                self.penalties.apply(logits, step.penalties)
            if step.bitmask is not None:
                apply_bitmask(logits, step.bitmask)
        tokens = sampler(logits, info)
        if step.penalties is not None:
            self.penalties.count(step.penalties, tokens)
        if step.layout is None:
            return tokens, None
        return tokens, self._scores(step, step.layout, raw, tokens, prompt_logits)

    def _scores(
        self,
        step: LogitsStep,
        layout: ScoreLayout,
        raw: torch.Tensor | None,
        tokens: torch.Tensor,
        prompt_logits: torch.Tensor,
    ) -> StepScores:
        sampled = None
        if step.logprob_rows is not None:
            sampled = tokens.index_select(0, step.logprob_rows)
        token, top_ids, top = _score(raw, sampled, layout.top_k, self.device)
        prompt_raw = None
        if step.prompt_targets is not None:
            prompt_raw = torch.log_softmax(prompt_logits.float(), dim=-1)
        prompt, prompt_top_ids, prompt_top = _score(
            prompt_raw, step.prompt_targets, layout.prompt_top_k, self.device
        )
        return StepScores(token, top_ids, top, prompt, prompt_top_ids, prompt_top)


def _score(
    logprobs: torch.Tensor | None, targets: torch.Tensor | None, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's logprob of its target and its ``k`` best (ids, logprobs); empty tensors for none."""
    if logprobs is None or targets is None:
        empty = torch.zeros(0, device=device)
        return (
            empty,
            torch.zeros((0, k), dtype=torch.int64, device=device),
            torch.zeros((0, k), device=device),
        )
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    best = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1)
    return chosen, best.indices, best.values
