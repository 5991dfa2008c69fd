"""ScheduleBatch: what one engine step computes, ready for a model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.req import Req

if TYPE_CHECKING:
    from radixserve.scheduler.memory.host_pool import KVLoad
    from radixserve.scheduler.memory.states import StatePlan
    from radixserve.scheduler.memory.tiered_cache import KVTransfers
    from radixserve.scheduler.model.logits import StepScores


def _empty() -> npt.NDArray[np.int64]:
    return np.zeros(0, dtype=np.int64)


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix, possibly one chunk
    DECODE = "decode"  # one new token per request


@dataclass(slots=True)
class ScoreLayout:
    """Which log-probabilities one step computes, for the requests that asked (the rest cost nothing).

    ``rows``: batch rows whose sampled token is scored, with up to ``top_k`` alternatives.
    ``prompt``: one span per request scoring prompt tokens this step, (batch row, first prompt position
    scored, count); the model also computes logits at ``prompt_index`` (batch-token indices: the
    position before each scored token) and scores ``prompt_targets`` (the tokens there), with
    ``prompt_top_k`` alternatives each. A prompt's last token predicts the first output: ``rows``'s.
    """

    rows: list[int]
    top_k: int
    prompt: list[tuple[int, int, int]]
    prompt_index: npt.NDArray[np.int64]
    prompt_targets: npt.NDArray[np.int64]
    prompt_top_k: int

    @classmethod
    def of(cls, batch: ScheduleBatch) -> ScoreLayout | None:
        rows: list[int] = []
        top_k = prompt_top_k = 0
        prompt: list[tuple[int, int, int]] = []
        index: list[npt.NDArray[np.int64]] = []
        targets: list[npt.NDArray[np.int32]] = []
        offset = 0
        lens = batch.extend_lens.tolist()
        for i, (r, n) in enumerate(zip(batch.reqs, lens, strict=True)):
            sp = r.sampling
            if sp.logprobs is not None and batch.token_index[i] >= 0:
                rows.append(i)
                top_k = max(top_k, sp.logprobs)
            if r.scores_prompt and batch.mode is ForwardMode.EXTEND:
                p = int(batch.prefix_lens[i])
                end = min(p + n, r.prompt_len - 1)  # positions p..end-1 predict prompt tokens p+1..end
                if end > p:
                    prompt.append((i, p + 1, end - p))
                    index.append(np.arange(offset, offset + end - p, dtype=np.int64))
                    targets.append(r.origin_ids[p + 1 : end + 1])
                    prompt_top_k = max(prompt_top_k, sp.prompt_logprobs or 0)
            offset += n
        if not rows and not prompt:
            return None
        none = np.zeros(0, dtype=np.int64)
        flat = np.concatenate(index) if index else none
        scored = np.concatenate(targets).astype(np.int64) if targets else none
        return cls(rows, top_k, prompt, flat, scored, prompt_top_k)


@dataclass(slots=True, eq=False)  # identity equality: batches are tracked in lists
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    input_ids: npt.NDArray[np.int32]  # tokens to feed, concatenated over requests
    positions: npt.NDArray[np.int64]  # their positions in their sequences
    out_slots: npt.NDArray[np.int64]  # KV slot each fed token writes
    prefix_lens: npt.NDArray[np.int64]  # per request: tokens already in KV before this step
    extend_lens: npt.NDArray[np.int64]  # per request: tokens fed this step (1 for decode)
    # Set when the batch is launched (BatchScheduler._commit), per request:
    token_index: npt.NDArray[np.int64] = field(default_factory=_empty)  # output index of its token, -1: none
    future_ids: npt.NDArray[np.int64] = field(default_factory=_empty)  # FutureMap id of its token, -1: none
    epochs: npt.NDArray[np.int64] = field(default_factory=_empty)  # req.retractions at launch
    # Set when the batch is planned (ModelRunner.plan), only when some request asks for more than a
    # sampled token (Req.special): the logprobs it computes, and whether a request is constrained.
    special: bool = False  # some request does (Req.special)
    scores: ScoreLayout | None = None
    constrained: bool = False
    states: StatePlan | None = None  # a hybrid model's state copies and snapshots (memory/states.py)
    # Host-tier copies to run before the forward (write-backs, then loads: memory/radix_cache.py)
    kv_transfers: KVTransfers | None = None
    # The requests its loads are for, with their tokens (each waits for them: it joins a later step,
    # or this one when ``kv_transfers.load_sync``): traces span their loads.
    kv_loads_for: list[tuple[Req, int]] = field(default_factory=list)
    # Set when the batch is prepared (ModelRunner.prepare) if it loads KV back: the loads' size and,
    # once the step has run, their time (metrics and traces read it).
    kv_load: KVLoad | None = None

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def extend(
        cls, reqs: list[Req], extend_lens: list[int], out_slots: npt.NDArray[np.int64]
    ) -> ScheduleBatch:
        prefix = np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=len(reqs))
        lens = np.asarray(extend_lens, dtype=np.int64)
        ids = np.concatenate([r.fill_ids()[p : p + n] for r, p, n in zip(reqs, prefix, lens, strict=True)])
        # positions: p, p+1, ..., p+n-1 for each request, without a Python loop per token
        starts = np.repeat(prefix - np.cumsum(lens) + lens, lens)
        positions = np.arange(int(lens.sum()), dtype=np.int64) + starts
        return cls(ForwardMode.EXTEND, reqs, ids, positions, out_slots, prefix, lens)

    @classmethod
    def decode(cls, reqs: list[Req], out_slots: npt.NDArray[np.int64]) -> ScheduleBatch:
        n = len(reqs)
        ids = np.fromiter((r.output_ids[-1] for r in reqs), dtype=np.int32, count=n)
        positions = np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=n)
        return cls(ForwardMode.DECODE, reqs, ids, positions, out_slots, positions, np.ones(n, dtype=np.int64))


def store_scores(batch: ScheduleBatch, scores: StepScores) -> None:
    """Hand a step's log-probabilities (host tensors) to the requests they belong to."""
    layout = batch.scores
    assert layout is not None
    token, top_ids, top = scores.token.tolist(), scores.top_ids.tolist(), scores.top.tolist()
    for j, row in enumerate(layout.rows):
        req = batch.reqs[row]
        if req.finish_reason is not None or req.retractions != batch.epochs[row]:
            continue  # its results are void (process skips it too)
        k = req.sampling.logprobs or 0
        # batches are processed in order and dropped tokens truncate the list: it is always the next
        assert batch.token_index[row] == len(req.output_logprobs)
        req.output_logprobs.append((token[j], top_ids[j][:k], top[j][:k]))
    if layout.prompt:
        prompt, p_ids, p_top = (
            scores.prompt.tolist(),
            scores.prompt_top_ids.tolist(),
            scores.prompt_top.tolist(),
        )
        j = 0  # the scores come in span order
        for row, first, count in layout.prompt:
            req = batch.reqs[row]
            k = req.sampling.prompt_logprobs or 0
            if req.prompt_logprobs is not None and req.retractions == batch.epochs[row]:
                req.prompt_logprobs[first : first + count] = [
                    (prompt[x], p_ids[x][:k], p_top[x][:k]) for x in range(j, j + count)
                ]
            j += count
