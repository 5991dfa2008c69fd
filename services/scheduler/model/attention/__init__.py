"""Attention backends behind one interface: the model's only view of the KV pool.

A backend is used in two phases per step:

* ``prepare(fb, rows)`` on the scheduler thread: reads the ReqToTokenPool once and builds the
  step's metadata (which KV slots each request attends to). The forward never reads the table
  itself, so a row reused by the next schedule cannot change a running step. A padded batch (the
  decode graphs' buckets, model/graph_runner.py) names ``ReqToTokenPool.scratch_row`` for its padding
  entries: a one-token context on the scratch KV slot, which no request owns.
* ``forward(layer, q, k, v, fb)`` per layer on the device stream: writes the new tokens'
  K/V into the pool at ``fb.out_slots``, then attends over each request's context.

The backends, one module each:

* ``torch`` (torch_ref.py): the reference, CPU and CUDA: gather by slot index + scaled dot-product
  attention per request.
* ``cpu`` (cpu.py + decode_attention.c): decode by a C kernel straight over the pool, the rest as
  ``torch``.
* ``flashinfer`` (flashinfer_backend.py): CUDA only; paged prefill and decode kernels, and decode
  wrappers with fixed buffers that CUDA graphs can replay.

``choose_backend`` resolves ``auto``: flashinfer on CUDA when it imports and supports the model's
dtype and head size; on CPU, ``cpu`` when its kernel builds, the pool is fp32 and torch runs one
intra-op thread; else ``torch``. The device profile (model/device.py) calls it; nothing here
imports the profile.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import numpy as np
import torch

from radixserve.scheduler.memory.kv_pool import KVPool
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.model.attention.torch_ref import TorchAttention, TorchMeta
from radixserve.scheduler.model.forward_batch import ForwardBatch

BACKENDS = ("torch", "cpu", "flashinfer")

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "GraphAttentionBackend",
    "TorchAttention",
    "TorchMeta",
    "choose_backend",
    "make_backend",
]


class AttentionBackend(Protocol):
    """What the runner and the model call on every backend (see the module doc for the phases)."""

    reads_device_table: bool  # its metadata comes from the ReqToTokenPool's device mirror

    def host_arrays(self, rows: np.ndarray, seq_lens: np.ndarray) -> dict[str, np.ndarray]: ...

    def prepare(self, fb: ForwardBatch, rows: np.ndarray) -> None: ...

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor: ...


class GraphAttentionBackend(AttentionBackend, Protocol):
    """A backend whose decode can be captured in CUDA graphs (flashinfer's)."""

    def init_graphs(self, buckets: list[int], max_pages_per_request: int) -> None: ...

    def graph_variants(self, bucket: int) -> list[tuple[int, object]]: ...

    def plan_graph(self, fb: ForwardBatch) -> int: ...


def choose_backend(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> str:
    """The backend ``auto`` means for this device, KV dtype and head shape."""
    from radixserve.scheduler.model.attention.cpu import unavailable_reason
    from radixserve.scheduler.model.attention.flashinfer_backend import unsupported_reason

    if device.type == "cpu":
        # The C kernel is single-threaded: with more torch threads the torch path keeps them busy.
        usable = torch.get_num_threads() == 1 and unavailable_reason(device, dtype) is None
        return "cpu" if usable else "torch"
    usable = unsupported_reason(device, dtype, num_heads, num_kv_heads, head_dim) is None
    return "flashinfer" if usable else "torch"


def make_backend(
    name: str,
    pool: KVPool,
    req_to_token: ReqToTokenPool,
    num_heads: int,
    head_dim: int,
    page_size: int = 1,
    flashinfer: ModuleType | None = None,
) -> AttentionBackend:
    """``flashinfer``: the module the flashinfer backend calls (None: imported)."""
    k0 = pool.k[0]
    num_kv_heads = int(k0.shape[1])
    if name == "auto":
        name = choose_backend(k0.device, k0.dtype, num_heads, num_kv_heads, head_dim)
    if name == "torch":
        return TorchAttention(pool, req_to_token, num_heads, head_dim)
    if name == "cpu":
        from radixserve.scheduler.model.attention.cpu import CpuAttention

        return CpuAttention(pool, req_to_token, num_heads, head_dim)
    if name == "flashinfer":
        from radixserve.scheduler.model.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(
            pool, req_to_token, num_heads, head_dim, page_size, num_kv_heads, flashinfer=flashinfer
        )
    raise ValueError(f"unknown attention backend {name!r}; choose auto, {', '.join(BACKENDS)}")
