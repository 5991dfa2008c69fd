"""The mixture-of-experts op: route each token to its top-k experts, run them, combine their outputs.

Contract (``Ops.moe``, model/ops.py): ``x`` ``[T, H]`` and ``router_logits`` ``[T, E]`` in, every
expert's weights stacked (``gate_up`` ``[E, 2I, H]``: gate rows, then up rows; ``down``
``[E, H, I]``) -> ``[T, H]`` in x's dtype: for each token, the sum over its top-k experts e of
``weight_e * down_e(silu(gate_e x) * up_e x)``. Under tensor parallelism every rank holds a slice
of each expert's ``I``, and the result is that rank's partial sum: the caller all-reduces it.

Routing (``route``) is the same on every device, HF's order of operations: softmax over all
experts in float32, the top k, then (``renormalize``) divided by their sum. The weights stay
float32 until they scale the experts' outputs, in x's dtype.

The experts run through one of two implementations with the same arguments (``EXPERTS``), which
the device profile picks once (model/device.py ``moe_experts``):

* ``torch``: the reference, any device and dtype. The (token, slot) rows are sorted by expert and
  each expert with rows runs as one matmul pair over its contiguous block: a loop over experts,
  never over tokens. It reads the per-expert row counts on the host, so a CUDA graph cannot hold it.
* ``grouped_mm``: ``torch.nn.functional.grouped_mm`` (documented in torch; CUTLASS grouped GEMMs on
  CUDA SM90 / SM100 in bfloat16): the same sorted rows, the group ends found on the device
  (``searchsorted``) and both projections as one grouped GEMM each. Every shape depends on T and
  k only and nothing is read back, so decode graphs capture it. Where torch has no such kernel
  (CPU, other GPUs, other dtypes) it loops over the groups itself and reads the ends on the host:
  correct but not capturable, so the profile picks it only where the kernel exists; the CPU tests
  run it that way to check everything around the kernel.

Both finish alike (``_combine``): each row's output goes back to its (token, slot) place, and one
batched matmul with the weights sums a token's k rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]  # [rows, 2I] -> [rows, I]: ops.silu_and_mul


@dataclass(frozen=True, slots=True)
class Routing:
    """Where a step's tokens go: each token's top-k experts and their weights, and its T*k
    (token, slot) rows sorted by expert (stable: in token order within an expert)."""

    ids: torch.Tensor  # [T, k] int64: each token's experts, most likely first
    weights: torch.Tensor  # [T, k] float32
    order: torch.Tensor  # [T*k]: each sorted row's flat (token, slot) index
    token: torch.Tensor  # [T*k]: each sorted row's token
    experts: torch.Tensor  # [T*k]: each sorted row's expert, ascending


Experts = Callable[[torch.Tensor, Routing, torch.Tensor, torch.Tensor, Activation], torch.Tensor]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    experts, order = torch.sort(ids.flatten(), stable=True)
    return Routing(ids, weights, order, order // top_k, experts)


def _combine(rows_out: torch.Tensor, r: Routing) -> torch.Tensor:
    """The sorted rows' outputs ``[T*k, H]`` weighted and summed per token -> ``[T, H]``."""
    tokens, k = r.weights.shape
    slots = torch.empty_like(rows_out).index_copy_(0, r.order, rows_out)  # back in (token, slot) order
    mixed = torch.bmm(r.weights.unsqueeze(1).to(slots.dtype), slots.view(tokens, k, -1))
    return mixed.squeeze(1)


def torch_experts(
    x: torch.Tensor, r: Routing, gate_up: torch.Tensor, down: torch.Tensor, act: Activation
) -> torch.Tensor:
    rows = x.index_select(0, r.token)
    counts = torch.bincount(r.experts, minlength=gate_up.shape[0]).tolist()  # the one host read
    out = torch.empty(rows.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            block = rows[start : start + n]
            out[start : start + n] = F.linear(act(F.linear(block, gate_up[e])), down[e])
        start += n
    return _combine(out, r)


def grouped_mm_experts(
    x: torch.Tensor, r: Routing, gate_up: torch.Tensor, down: torch.Tensor, act: Activation
) -> torch.Tensor:
    every = torch.arange(gate_up.shape[0], device=x.device, dtype=r.experts.dtype)
    ends = torch.searchsorted(r.experts, every, right=True, out_int32=True)  # group e ends at ends[e]
    rows = x.index_select(0, r.token)
    # grouped_mm computes a @ b per group with b [E, K, N]; our [E, N, K] weights, transposed, are
    # the column-major operand its kernels want, without a copy.
    hidden = act(F.grouped_mm(rows, gate_up.transpose(1, 2), offs=ends))
    return _combine(F.grouped_mm(hidden, down.transpose(1, 2), offs=ends), r)


EXPERTS: dict[str, Experts] = {"torch": torch_experts, "grouped_mm": grouped_mm_experts}


def grouped_mm_unsupported(
    device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None, widths: tuple[int, ...]
) -> str | None:
    """Why ``grouped_mm`` would not run as a capturable grouped GEMM here (None: it would).
    ``capability``: the CUDA device's (major, minor); ``widths``: the hidden size and the experts'
    (this rank's) MLP widths, every row of which must start 16-byte aligned."""
    if device.type != "cuda" or capability is None:
        return "grouped GEMM kernels need a CUDA device"
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if dtype != torch.bfloat16:
        return f"torch's grouped GEMM kernels are bfloat16 only, not {str(dtype).removeprefix('torch.')}"
    if capability[0] not in (9, 10):
        return (
            f"torch's grouped GEMM kernels are built for SM90 / SM100, not SM{capability[0]}{capability[1]}"
        )
    if any(w % 8 for w in widths):
        return f"grouped GEMM rows must be 16-byte aligned: widths {widths} are not all multiples of 8"
    return None
