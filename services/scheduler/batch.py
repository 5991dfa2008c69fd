"""ScheduleBatch: what one engine step computes, ready for a model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from radixserve.scheduler.req import Req


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix, possibly one chunk
    DECODE = "decode"  # one new token per request


@dataclass(slots=True, eq=False)  # identity equality: batches are tracked in lists
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    input_ids: np.ndarray  # tokens to feed, concatenated over requests (int32)
    positions: np.ndarray  # their positions in their sequences (int64)
    out_slots: np.ndarray  # KV slot each fed token writes (int64)
    prefix_lens: np.ndarray  # per request: tokens already in KV before this step
    extend_lens: np.ndarray  # per request: tokens fed this step (1 for decode)
    # Set when the batch is launched (BatchScheduler._commit), per request:
    token_index: np.ndarray = field(default_factory=_empty)  # output index of its token, -1: none
    future_ids: np.ndarray = field(default_factory=_empty)  # FutureMap id of its token, -1: none
    epochs: np.ndarray = field(default_factory=_empty)  # req.retractions at launch

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def extend(cls, reqs: list[Req], extend_lens: list[int], out_slots: np.ndarray) -> ScheduleBatch:
        prefix = np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=len(reqs))
        lens = np.asarray(extend_lens, dtype=np.int64)
        ids = np.concatenate([r.fill_ids()[p : p + n] for r, p, n in zip(reqs, prefix, lens, strict=True)])
        # positions: p, p+1, ..., p+n-1 for each request, without a Python loop per token
        starts = np.repeat(prefix - np.cumsum(lens) + lens, lens)
        positions = np.arange(int(lens.sum()), dtype=np.int64) + starts
        return cls(ForwardMode.EXTEND, reqs, ids, positions, out_slots, prefix, lens)

    @classmethod
    def decode(cls, reqs: list[Req], out_slots: np.ndarray) -> ScheduleBatch:
        n = len(reqs)
        ids = np.fromiter((r.output_ids[-1] for r in reqs), dtype=np.int32, count=n)
        positions = np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=n)
        return cls(ForwardMode.DECODE, reqs, ids, positions, out_slots, positions, np.ones(n, dtype=np.int64))
