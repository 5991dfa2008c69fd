"""The reference attention backend (CPU and CUDA): gather each request's context, then SDPA.

The two-phase backend contract is described in ``attention/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.forward_batch import ForwardBatch


@dataclass(slots=True)
class TorchMeta:
    slots: torch.Tensor  # every request's whole context, concatenated: [sum(seq_lens)] KV slots
    ctx: list[tuple[int, int]]  # per request, its range in ``slots``
    queries: list[tuple[int, int]]  # per request, its range of query tokens in the batch
    masks: list[torch.Tensor | None]  # per request, [n, seq] for an extend on a prefix, else None
    causal: list[bool]  # per request, plain causal (a fresh prefill of more than one token)
    starts: torch.Tensor | None = None  # cpu backend, decode: [B + 1] offsets of ``ctx`` (host)


class TorchAttention:
    """Reference backend: gather each request's exact context, then one SDPA call per request.

    The gather copies rows of the pool into a buffer reused across layers and steps (no padding
    to the longest context, no fresh allocation per layer); per-request SDPA needs no padding
    mask, so the CPU takes its fused path.
    """

    name = "torch"
    reads_device_table = False  # its metadata comes from the host table

    def __init__(self, pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self.device = pool.k[0].device
        self._buf_k = self._buf_v = pool.k[0][:0]

    def host_arrays(self, rows: np.ndarray, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
        """Nothing beyond the step's inputs to stage (see FlashInferAttention.host_arrays)."""
        return {}

    def prepare(self, fb: ForwardBatch, rows: np.ndarray) -> None:
        host = self.req_to_token.host
        seq = fb.prefix_lens + fb.extend_lens
        width = int(seq.max())
        valid = np.arange(width)[None, :] < seq[:, None]
        flat = host[rows, :width][valid].astype(np.int64)  # row-major: request by request
        ends = np.cumsum(seq).tolist()
        q_ends = np.cumsum(fb.extend_lens).tolist()
        ctx = list(zip([0, *ends[:-1]], ends, strict=True))
        queries = list(zip([0, *q_ends[:-1]], q_ends, strict=True))
        masks: list[torch.Tensor | None] = []
        causal: list[bool] = []
        for p, n in zip(fb.prefix_lens.tolist(), fb.extend_lens.tolist(), strict=True):
            if p > 0 and n > 1:  # query i (position p + i) sees keys 0 .. p + i
                q_pos = torch.arange(p, p + n, device=self.device)[:, None]
                masks.append(torch.arange(p + n, device=self.device)[None, :] <= q_pos)
            else:
                masks.append(None)
            causal.append(p == 0 and n > 1)
        fb.attn = TorchMeta(torch.from_numpy(flat).to(self.device), ctx, queries, masks, causal)

    def _gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(slots)
        if len(self._buf_k) < n:  # grow-only: steady state allocates nothing
            shape = (max(n, 2 * len(self._buf_k)), *self.pool.k[0].shape[1:])
            self._buf_k = self.pool.k[0].new_empty(shape)
            self._buf_v = self.pool.k[0].new_empty(shape)
        k = torch.index_select(self.pool.k[layer], 0, slots, out=self._buf_k[:n])
        v = torch.index_select(self.pool.v[layer], 0, slots, out=self._buf_v[:n])
        return k, v

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H * D]."""
        self.pool.write(layer, fb.out_slots, k, v)
        meta = cast(TorchMeta, fb.attn)
        keys, vals = self._gather(layer, meta.slots)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        per_request = zip(meta.ctx, meta.queries, meta.masks, meta.causal, strict=True)
        for (c0, c1), (q0, q1), mask, causal in per_request:
            qi = q[q0:q1].transpose(0, 1)[None]  # [1, H, n, D]
            ki = keys[c0:c1].transpose(0, 1)[None]  # [1, Hkv, S, D]
            vi = vals[c0:c1].transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )
            out[q0:q1] = oi[0].transpose(0, 1).reshape(q1 - q0, -1)
        return out
