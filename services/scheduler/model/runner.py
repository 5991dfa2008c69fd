"""ModelRunner: the model, its KV pool, the attention backend, the sampler and the FutureMap.

``prepare`` runs on the scheduler thread (host work: tensors, attention metadata);
``forward`` runs on the device stream: it resolves placeholder input tokens from the
FutureMap, runs the model, samples, and stores the sampled tokens back into the FutureMap
so that a batch launched before this one's results were read can already feed them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.attention import make_backend
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.sampler import Sampler, SamplingInfo
from radixserve.scheduler.policy.batch import ScheduleBatch


class FutureMap:
    """Tokens sampled on the device, named by id before they exist.

    Ids grow without bound on the host; on the device they live in a ring big enough for
    every batch that can be in flight at once (a placeholder is read only by the batch
    scheduled right after its own). The extra last entry takes tokens nobody will read
    (the discarded token of a prefill chunk).
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.tokens = torch.zeros(capacity + 1, dtype=torch.int64, device=device)

    def slots(self, future_ids: np.ndarray) -> np.ndarray:
        return np.where(future_ids >= 0, future_ids % self.capacity, self.capacity)

    def encode_inputs(self, ids: np.ndarray) -> np.ndarray:
        """Input ids with placeholders (-1 - future id) rewritten to -1 - ring slot."""
        neg = ids < 0
        if neg.any():
            ids = ids.astype(np.int64, copy=True)
            ids[neg] = -1 - ((-1 - ids[neg]) % self.capacity)
        return ids

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids < 0, self.tokens[(-1 - ids).clamp(min=0)], ids)


class ModelRunner:
    def __init__(
        self,
        model_path: str | Path,
        model_config: ModelConfig,
        req_to_token: ReqToTokenPool,
        pool_slots: int,
        max_batch: int,
        attention_backend: str = "auto",
        device: str = "cpu",
        page_size: int = 1,
    ) -> None:
        self.device = torch.device(device)
        self.config = model_config
        self.model = load_model(model_path, model_config, self.device)
        self.req_to_token = req_to_token
        mc = model_config
        self.kv_pool = KVPool(pool_slots, mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, self.device)
        self.backend = make_backend(
            attention_backend, self.kv_pool, req_to_token, mc.num_heads, mc.head_dim, page_size
        )
        self.sampler = Sampler()
        self.futures = FutureMap(4 * max_batch + 8, self.device)

    def prepare(self, batch: ScheduleBatch) -> ForwardBatch:
        """Host side of a step (scheduler thread)."""
        dev = self.device
        rows = np.fromiter((r.req_pool_idx for r in batch.reqs), dtype=np.int64, count=batch.size)
        fb = ForwardBatch(
            mode=batch.mode,
            input_ids=torch.from_numpy(self.futures.encode_inputs(batch.input_ids.astype(np.int64))).to(dev),
            positions=torch.from_numpy(batch.positions).to(dev),
            out_slots=torch.from_numpy(batch.out_slots.astype(np.int64)).to(dev),
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            future_out=torch.from_numpy(self.futures.slots(batch.future_ids)).to(dev),
            sampling=SamplingInfo.from_params(
                [r.sampling for r in batch.reqs], np.maximum(batch.token_index, 0).tolist(), dev
            ),
        )
        # Built here, not in forward: a host->device copy on the device stream would wait for it.
        fb.last_index = torch.from_numpy(np.cumsum(batch.extend_lens) - 1).to(dev)
        self.backend.prepare(fb, rows)
        return fb

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Device side of a step: returns the sampled tokens [B] (on the device)."""
        ids = self.futures.resolve(fb.input_ids)
        logits = self.model(ids, fb.positions, fb, self.backend)
        tokens = self.sampler(logits, fb.sampling)
        self.futures.tokens[fb.future_out] = tokens
        return tokens
