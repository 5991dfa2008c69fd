"""ScheduleBatch: what one engine step computes, ready for a model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import numpy.typing as npt

from radixserve.scheduler.req import Req


def _empty() -> npt.NDArray[np.int64]:
    return np.zeros(0, dtype=np.int64)


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix, possibly one chunk
    DECODE = "decode"  # one new token per request


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
