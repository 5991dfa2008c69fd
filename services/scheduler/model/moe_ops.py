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

FP8 experts (``Fp8Experts``, model/quant/): each stack is an ``Fp8Weight`` instead of a tensor, and
every implementation takes either (``Stack``). The torch reference dequantizes the experts that
have rows, one at a time, per call; ``grouped_mm`` dequantizes the whole stack per call (correct,
but a layer's experts in the serving dtype for a moment: the profile never picks it for FP8
experts); a third, ``scaled_grouped_mm`` (quant/grouped.py), runs FP8 x FP8 grouped GEMMs, the
same sorted rows and device-side group ends as ``grouped_mm``, and hands high-precision stacks to
it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.scheduler.model.quant.grouped import SCALED_GROUPED, scaled_grouped_mm
from radixserve.scheduler.model.quant.linear import Fp8Weight

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


Stack = torch.Tensor | Fp8Weight  # a layer's experts' weights stacked [E, N, K]: as served, or FP8
Experts = Callable[[torch.Tensor, Routing, Stack, Stack, Activation], torch.Tensor]


def _expert(stack: Stack, e: int, dtype: torch.dtype) -> torch.Tensor:
    return stack[e] if isinstance(stack, torch.Tensor) else stack.expert(e, dtype)


def _whole(stack: Stack, dtype: torch.dtype) -> torch.Tensor:
    return stack if isinstance(stack, torch.Tensor) else stack.dequantize(dtype)


def _group_ends(r: Routing, num_experts: int) -> torch.Tensor:
    """Where each expert's rows end among the sorted rows (int32, on the device: no host read)."""
    every = torch.arange(num_experts, device=r.experts.device, dtype=r.experts.dtype)
    return torch.searchsorted(r.experts, every, right=True, out_int32=True)


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


def torch_experts(x: torch.Tensor, r: Routing, gate_up: Stack, down: Stack, act: Activation) -> torch.Tensor:
    rows = x.index_select(0, r.token)
    num, hidden = gate_up.shape[0], down.shape[1]
    counts = torch.bincount(r.experts, minlength=num).tolist()  # the one host read
    out = torch.empty(rows.shape[0], hidden, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            block = rows[start : start + n]
            inner = act(F.linear(block, _expert(gate_up, e, x.dtype)))
            out[start : start + n] = F.linear(inner, _expert(down, e, x.dtype))
        start += n
    return _combine(out, r)


def grouped_mm_experts(
    x: torch.Tensor, r: Routing, gate_up: Stack, down: Stack, act: Activation
) -> torch.Tensor:
    ends = _group_ends(r, gate_up.shape[0])  # group e ends at ends[e]
    rows = x.index_select(0, r.token)
    # grouped_mm computes a @ b per group with b [E, K, N]; our [E, N, K] weights, transposed, are
    # the column-major operand its kernels want, without a copy.
    hidden = act(F.grouped_mm(rows, _whole(gate_up, x.dtype).transpose(1, 2), offs=ends))
    return _combine(F.grouped_mm(hidden, _whole(down, x.dtype).transpose(1, 2), offs=ends), r)


def scaled_grouped_mm_experts(
    x: torch.Tensor, r: Routing, gate_up: Stack, down: Stack, act: Activation
) -> torch.Tensor:
    """FP8 experts scaled per output row on FP8 grouped GEMMs (quant/grouped.py); others as
    ``grouped_mm``."""
    if not (isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight) and gate_up.layout.block is None):
        return grouped_mm_experts(x, r, gate_up, down, act)
    ends = _group_ends(r, gate_up.shape[0])
    rows = x.index_select(0, r.token)
    hidden = act(scaled_grouped_mm(rows, gate_up.weight, gate_up.weight_scale, ends))
    return _combine(scaled_grouped_mm(hidden, down.weight, down.weight_scale, ends), r)


EXPERTS: dict[str, Experts] = {
    "torch": torch_experts,
    "grouped_mm": grouped_mm_experts,
    SCALED_GROUPED: scaled_grouped_mm_experts,
}


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
