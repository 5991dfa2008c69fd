"""ForwardBatch: one engine step's inputs as device tensors, plus what the attention backend needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.scheduler.policy.batch import ForwardMode


@dataclass(slots=True, eq=False)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64; negative ids name FutureMap entries not yet sampled
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: where each token's K/V is written
    prefix_lens: np.ndarray  # [B] host
    extend_lens: np.ndarray  # [B] host
    future_out: torch.Tensor  # [B] int64: FutureMap entries the sampled tokens go to
    sampling: Any  # SamplingInfo for the batch
    last_index: torch.Tensor | None = None  # [B] each request's last token in the batch (device)
    attn: Any = None  # backend metadata, built by AttentionBackend.prepare on the scheduler thread
    all_logits: bool = False  # return logits for every token (tests), not just each request's last

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)
