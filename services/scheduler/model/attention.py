"""Attention backends behind one interface.

A backend is used in two phases per step:

* ``prepare(fb, rows)`` on the scheduler thread: reads the host ReqToTokenPool once and
  builds the step's metadata (which KV slots each request attends to). The forward never
  reads the table itself, so a row reused by the next schedule cannot change a running step.
* ``forward(layer, q, k, v, fb)`` per layer on the device stream: writes the new tokens'
  K/V into the pool at ``fb.out_slots``, then attends over each request's context.

``torch`` is the reference (CPU and CUDA): gather by slot index + scaled dot-product
attention. ``flashinfer`` (CUDA only, model/flashinfer_backend.py); ``auto`` picks it when
it is installed and supports the model's dtype and head size, else ``torch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.policy.batch import ForwardMode


@dataclass(slots=True)
class _DecodeMeta:
    slots: torch.Tensor  # [B, L] KV slots, padded with the scratch slot
    mask: torch.Tensor  # [B, 1, 1, L] True where a key is attended


@dataclass(slots=True)
class _ExtendMeta:
    slots: list[torch.Tensor]  # per request, [seq_len] KV slots
    starts: list[int]  # per request, first token in the batch
    masks: list[torch.Tensor | None]  # per request, [ext, seq] or None for plain causal


class TorchAttention:
    name = "torch"

    def __init__(self, pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self.device = pool.k[0].device

    def prepare(self, fb: ForwardBatch, rows: np.ndarray) -> None:
        host = self.req_to_token.host
        seq = fb.prefix_lens + fb.extend_lens
        if fb.mode is ForwardMode.DECODE:
            width = int(seq.max())
            slots = host[rows, :width].astype(np.int64)
            valid = np.arange(width)[None, :] < seq[:, None]
            slots[~valid] = 0  # scratch slot: read, never attended
            fb.attn = _DecodeMeta(
                torch.from_numpy(slots).to(self.device, non_blocking=True),
                torch.from_numpy(valid[:, None, None, :]).to(self.device, non_blocking=True),
            )
            return
        starts = np.concatenate([[0], np.cumsum(fb.extend_lens)[:-1]]).tolist()
        slot_list: list[torch.Tensor] = []
        masks: list[torch.Tensor | None] = []
        for row, p, n in zip(rows, fb.prefix_lens, fb.extend_lens, strict=True):
            slot_list.append(torch.from_numpy(host[row, : p + n].astype(np.int64)).to(self.device))
            if p == 0:
                masks.append(None)
            else:  # query i (absolute position p + i) sees keys 0 .. p + i
                q_pos = torch.arange(p, p + n, device=self.device)[:, None]
                masks.append(torch.arange(p + n, device=self.device)[None, :] <= q_pos)
        fb.attn = _ExtendMeta(slot_list, starts, masks)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch):
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H * D]."""
        self.pool.write(layer, fb.out_slots, k, v)
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        meta = fb.attn
        if isinstance(meta, _DecodeMeta):
            keys = kp[meta.slots].transpose(1, 2)  # [B, Hkv, L, D]
            vals = vp[meta.slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, vals, attn_mask=meta.mask, scale=self.scale, enable_gqa=True
            )
            return out.reshape(q.shape[0], -1)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for slots, start, mask, n in zip(meta.slots, meta.starts, meta.masks, fb.extend_lens, strict=True):
            qi = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
            ki = kp[slots].transpose(0, 1)[None]  # [1, Hkv, S, D]
            vi = vp[slots].transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[start : start + n] = oi[0].transpose(0, 1).reshape(n, -1)
        return out


def make_backend(
    name: str, pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int, head_dim: int, page_size: int = 1
):
    from radixserve.scheduler.model.flashinfer_backend import FlashInferAttention, unsupported_reason

    k0 = pool.k[0]
    num_kv_heads = int(k0.shape[1])
    if name == "auto":
        usable = unsupported_reason(k0.device, k0.dtype, num_heads, num_kv_heads, head_dim) is None
        name = "flashinfer" if usable else "torch"
    if name == "torch":
        return TorchAttention(pool, req_to_token, num_heads, head_dim)
    if name == "flashinfer":
        return FlashInferAttention(pool, req_to_token, num_heads, head_dim, page_size, num_kv_heads)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or flashinfer")
