"""Req: one request's state inside the scheduler pod."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from radixserve.common.sampling import SamplingParams

if TYPE_CHECKING:
    from radixserve.scheduler.grammar import GrammarMatcher
    from radixserve.scheduler.memory.radix_cache import MatchResult, TreeNode


class FinishReason(str, Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # EOS or a stop token
    ABORT = "abort"  # client gone, deadline, shutdown


# One token's log-probability, its top alternatives' ids and log-probabilities (most likely first).
TokenLogprob = tuple[float, list[int], list[float]]


@dataclass(eq=False, slots=True)
class Req:
    rid: str
    origin_ids: npt.NDArray[np.int32]  # prompt token ids (__post_init__ makes any ints int32)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)

    # Memory (see the ownership diagram in memory/radix_cache.py).
    req_pool_idx: int | None = None  # row in ReqToTokenPool while it holds KV
    last_node: TreeNode | None = None  # locked tree node ending at cached_len
    cached_len: int = 0  # leading tokens whose pages the tree owns
    kv_len: int = 0  # leading tokens whose KV is written
    alloc_len: int = 0  # leading tokens that have a slot
    # Hybrid models (memory/states.py): the state slot its row's state is copied from at its first
    # step after admission (-1: none pending), and where its prompt left the cached KV then.
    state_src: int = -1
    branch_len: int = 0

    # Scheduling.
    match_len: int = 0  # cached prefix found by the last match (for the policy's ordering)
    last_match: tuple[int, MatchResult] | None = None  # (cache version, match) while waiting
    admit_time: float | None = None  # first admission (for queue-wait metrics)
    # Fairness counts time spent waiting, not running: ``now - queue_time`` is the total wait of
    # a waiting request. Set at arrival; on admission the wait is banked in ``waited``; on
    # retraction ``queue_time = now - waited``, so the clock resumes where it stopped.
    queue_time: float = -1.0
    waited: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens served from cache at first admission
    loaded_len: int = 0  # of cached_len at its last admission: tokens loaded back from the host tier
    # Device slots loaded back from the host for it (while it waited a step for its load, or by an
    # admission undone for want of room): its host hits at its next admission, those its match still
    # holds (KVCacheManager.admit); dropped when it ends or is retracted.
    loaded_slots: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # It waits for a load started for it (PrefillAdder): its room was checked then, as for an
    # admission, so it is admitted without keeping other requests' prefixes (``keep_wanted``).
    load_started: bool = False
    retractions: int = 0
    finish_reason: FinishReason | None = None

    # Asked-for extras (SamplingParams.logprobs / prompt_logprobs / constraint).
    # output_logprobs[i]: output token i's (logprob, top ids, top logprobs), filled as tokens arrive.
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt_logprobs[i]: prompt token i's, by position (a re-prefill after retraction rewrites the same
    # entries); entry 0 stays None (nothing predicts the first token).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar: GrammarMatcher | None = None  # the constraint's state: the tokens accepted so far
    special: bool = False  # set from ``sampling`` (__post_init__)
    # sampling.logit_bias as (token ids int64, values float32), built once (the sampler reads it every step)
    logit_bias: tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]] | None = None
    _fill_cache: npt.NDArray[np.int32] | None = None

    def __post_init__(self) -> None:
        self.origin_ids = np.asarray(self.origin_ids, dtype=np.int32)
        if self.queue_time < 0:
            self.queue_time = self.arrival_time
        sp = self.sampling
        if sp.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.origin_ids)
        if sp.logit_bias:
            self.logit_bias = (
                np.array([t for t, _ in sp.logit_bias], dtype=np.int64),
                np.array([v for _, v in sp.logit_bias], dtype=np.float32),
            )
        # Asks the step for more than a sampled token (model/logits.py); checked per step, so kept here.
        self.special = (
            sp.logprobs is not None
            or sp.prompt_logprobs is not None
            or sp.penalized
            or sp.constraint is not None
            or sp.min_new_tokens > 0
        )

    @property
    def scores_prompt(self) -> bool:
        """Whether the next prefill must score prompt positions: asked, and not all scored yet (a
        request retracted after its prompt was scored re-prefills like any other)."""
        scored = self.prompt_logprobs
        return scored is not None and len(scored) > 1 and scored[-1] is None

    @property
    def prompt_len(self) -> int:
        return len(self.origin_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence so far: prompt plus outputs."""
        return len(self.origin_ids) + len(self.output_ids)

    def fill_ids(self) -> npt.NDArray[np.int32]:
        """Prompt + outputs as one array (built lazily; outputs only grow)."""
        n = self.seq_len
        cached = self._fill_cache
        if cached is None or len(cached) != n:
            cached = np.concatenate([self.origin_ids, np.asarray(self.output_ids, dtype=np.int32)])
            self._fill_cache = cached
        return cached

    @property
    def remaining_prefill(self) -> int:
        """Tokens whose KV must be computed before this request can decode."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # Output tokens: a negative value is a placeholder for a token sampled by a batch still in
    # flight (BatchScheduler._commit appends it, BatchScheduler.process replaces it and clears
    # _fill_cache); placeholders only ever sit at the end.
    def truncate_output(self, n: int) -> None:
        if len(self.output_ids) > n:
            del self.output_ids[n:]
            self._fill_cache = None
        if len(self.output_logprobs) > n:
            del self.output_logprobs[n:]

    @property
    def known_len(self) -> int:
        """Tokens of the sequence whose value is known (placeholders excluded)."""
        n = len(self.output_ids)
        while n and self.output_ids[n - 1] < 0:
            n -= 1
        return len(self.origin_ids) + n

    def drop_pending(self) -> None:
        """Forget tokens not sampled yet (their batch's results will be ignored)."""
        self.truncate_output(self.known_len - len(self.origin_ids))
