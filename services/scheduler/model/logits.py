"""Between the model and the sampler: what a step does to its logits for the requests that ask.

In this order, on the device:

1. log-probabilities of the *raw* logits (``log_softmax`` before any of the below) for the rows whose
   request asked (``SamplingParams.logprobs``); the prompt positions of requests scoring their prompt
   (``prompt_logprobs``, ``ScoreLayout.prompt_index``) the model scores itself, in slices
   (``CausalLM._score_prompt``), and they are collected here;
2. ``logit_bias``: added to the named tokens' logits; before ``min_new_tokens`` the EOS and stop
   tokens get ``-inf`` the same way;
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

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode, ScheduleBatch, ScoreLayout
from radixserve.scheduler.grammar import GrammarMatcher, allocate_bitmask, apply_bitmask, fill_masks
from radixserve.scheduler.model.penalties import PenaltyState, PenaltyStep
from radixserve.scheduler.model.sampler import Sampler, SamplingInfo
from radixserve.scheduler.model.staging import to_device


@dataclass(slots=True)
class LogitsStep:
    """One step's logits work, built on the scheduler thread; None fields are skipped."""

    layout: ScoreLayout | None
    logprob_rows: torch.Tensor | None  # [R] int64: rows of the logits whose sampled token is scored
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    penalties: PenaltyStep | None
    bitmask: torch.Tensor | None  # [B, W] int32 (grammar.mask_width): bit 0 = the token is refused


# The model's scores of prompt positions: each one's log-probability of its next prompt token, and
# its top ids and their log-probabilities.
PromptScores = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
    def __init__(
        self, num_slots: int, vocab_size: int, device: torch.device, eos_token_ids: Sequence[int] = ()
    ) -> None:
        """``num_slots``: rows of the ReqToTokenPool (a request's row keys its penalty counts);
        ``eos_token_ids``: what min_new_tokens holds back besides a request's stop tokens."""
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.penalties = PenaltyState(num_slots, vocab_size, device)

    # --------------------------------------------------------------------- host (scheduler thread)
    def plan(self, batch: ScheduleBatch) -> LogitsStep | None:
        layout = batch.scores
        sampled = batch.token_index >= 0  # rows that sample a token this step (not a prefill chunk)
        extend = batch.mode is ForwardMode.EXTEND
        bias: list[tuple[int, np.ndarray, np.ndarray]] = []  # (row, token ids, values)
        pen_rows: list[int] = []
        pen_slots: list[int] = []
        pen_params: list[tuple[float, float, float]] = []
        resets: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        constrained: list[tuple[int, GrammarMatcher]] = []
        for i, r in enumerate(batch.reqs):
            sp = r.sampling
            early = sp.min_new_tokens > batch.token_index[i]  # its token comes before min_new_tokens
            if not sampled[i] or (not sp.penalized and r.grammar is None and not early):
                continue
            if r.grammar is not None:
                constrained.append((i, r.grammar))
            if r.logit_bias is not None:  # (ids checked against the vocabulary at admission)
                bias.append((i, *r.logit_bias))
            if early:
                banned = self._early_stops(sp)
                if len(banned):
                    bias.append((i, banned, np.full(len(banned), -np.inf, dtype=np.float32)))
            if sp.has_penalties:
                assert r.req_pool_idx is not None
                pen_rows.append(i)
                pen_slots.append(r.req_pool_idx)
                pen_params.append((sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty))
                if extend:
                    # Its first sample on this row (after admission or a retraction): rebuild the row
                    # from the tokens known here; from now on the device counts each step's token.
                    known = np.asarray(r.output_ids[: int(batch.token_index[i])], dtype=np.int64)
                    resets.append((r.req_pool_idx, self._ids(r.origin_ids), self._ids(known)))
        if layout is None and not bias and not pen_rows and not constrained:
            return None
        bitmask = None
        if constrained:
            host = allocate_bitmask(batch.size, self.vocab_size, pin_memory=self.device.type == "cuda")
            fill_masks(constrained, host)  # rows filled in parallel on llguidance's threads (no GIL)
            bitmask = to_device(host, self.device)[1]
        return LogitsStep(
            layout=layout,
            logprob_rows=self._ids(layout.rows) if layout is not None and layout.rows else None,
            bias=self._bias(bias) if bias else None,
            penalties=PenaltyStep(self._ids(pen_rows), self._ids(pen_slots), self._floats(pen_params), resets)
            if pen_rows
            else None,
            bitmask=bitmask,
        )

    def _early_stops(self, sp: SamplingParams) -> np.ndarray:
        """The tokens that would end a request: what min_new_tokens masks."""
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        return np.array(sorted(t for t in stops if t < self.vocab_size), dtype=np.int64)

    def _bias(
        self, bias: list[tuple[int, np.ndarray, np.ndarray]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, token ids, values) of every biased logit, from each request's arrays (Req.logit_bias)."""
        rows = np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, ids, _ in bias])
        ids = np.concatenate([ids for _, ids, _ in bias])
        values = np.concatenate([v for _, _, v in bias])
        return self._ids(rows), self._ids(ids), self._floats(values)

    def _ids(self, values: object) -> torch.Tensor:
        return to_device(torch.as_tensor(np.asarray(values, dtype=np.int64)), self.device)[1]

    def _floats(self, values: object) -> torch.Tensor:
        return to_device(torch.as_tensor(np.asarray(values, dtype=np.float32)), self.device)[1]

    # ---------------------------------------------------------------------------- device stream
    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingInfo,
        step: LogitsStep,
        sampler: Sampler,
        prompt_scores: PromptScores | None = None,
    ) -> tuple[torch.Tensor, StepScores | None]:
        """``logits`` [B, V]: each request's last position; ``prompt_scores``: the model's scores of
        ``step.layout.prompt`` (ModelOutput.prompt_scores). Returns the sampled tokens [B] and the
        step's scores (None when none were asked for)."""
        raw = None
        if step.logprob_rows is not None:
            raw = torch.log_softmax(logits.index_select(0, step.logprob_rows), dim=-1)
        if step.bias is not None or step.penalties is not None or step.bitmask is not None:
            logits = logits.clone()  # the model's output may be a captured graph's buffer
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
        layout = step.layout
        if layout is None:
            return tokens, None
        if raw is not None and step.logprob_rows is not None:
            sampled = tokens.index_select(0, step.logprob_rows)
            best = torch.topk(raw, min(layout.top_k, raw.shape[1]), dim=-1)
            token = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)
            top_ids, top = best.indices, best.values
        else:
            token, top_ids, top = _empty(layout.top_k, self.device)
        prompt, prompt_ids, prompt_top = prompt_scores or _empty(layout.prompt_top_k, self.device)
        return tokens, StepScores(token, top_ids, top, prompt, prompt_ids, prompt_top)


def _empty(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """No scores: (logprobs [0], top ids [0, k], top logprobs [0, k])."""
    return (
        torch.zeros(0, device=device),
        torch.zeros((0, k), dtype=torch.int64, device=device),
        torch.zeros((0, k), device=device),
    )
