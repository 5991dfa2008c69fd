"""The gated delta rule's two implementations, behind one small interface, chosen by the device profile.

* ``TorchDeltaRule``: model/gated_delta.py, every device and dtype: one sequence at a time for a
  prefill (the chunked form), the whole batch at once for a decode step.
* ``FlaDeltaRule``: flash-linear-attention's Triton kernels (the ``fla-core`` package, import name
  ``fla``), written against its documented API: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
  for prefill, every sequence of a step in one varlen call (``cu_seqlens``, initial and final states
  ``[N, H, K, V]``), and ``fused_recurrent_gated_delta_rule`` for decode. They need CUDA and a 16-bit
  dtype. Not run here: no machine this was developed on has a GPU, so this path has not run at all;
  the profile picks it only when ``fla`` imports on a CUDA device in float16/bfloat16, logs it, and
  the torch path is what every test holds to HF.

Both take q and k already L2-normalised (q scaled by ``Dk ** -0.5``) with the value heads' count of
heads (grouped heads repeated), in float32, and return float32 outputs and states.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Protocol

import torch

from radixserve.scheduler.model import gated_delta

LINEAR_KERNELS = ("torch", "fla")


class DeltaRule(Protocol):
    name: str

    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        lens: list[int],
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences of ``lens[i]`` tokens one after another in the packed tokens (q ``[T, H, Dk]`` ...),
        sequence i starting from ``states[i]`` (``[N, H, Dk, Dv]``) -> (outputs ``[T, H, Dv]``, each
        sequence's final state ``[N, ...]``)."""
        ...

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row (q ``[B, H, Dk]`` ...) -> (outputs ``[B, H, Dv]``, new states)."""
        ...


class TorchDeltaRule:
    name = "torch"

    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        lens: list[int],
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
        finals = []
        a = 0
        for i, n in enumerate(lens):
            b = a + n
            out[a:b], final = gated_delta.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[i])
            finals.append(final)
            a = b
        return out, torch.stack(finals)

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gated_delta.recurrent_step(q, k, v, g, beta, states)


class FlaDeltaRule:
    """flash-linear-attention's kernels (CUDA, fp16/bf16). ``fla`` may be injected (tests)."""

    name = "fla"

    def __init__(self, dtype: torch.dtype, fla: ModuleType | None = None) -> None:
        ops = fla if fla is not None else importlib.import_module("fla.ops.gated_delta_rule")
        self.chunk, self.recurrent = ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule
        self.dtype = dtype

    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        lens: list[int],
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cuts = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)
        o, final = self.chunk(
            *(x[None].to(self.dtype) for x in (q, k, v)), g[None], beta[None].to(self.dtype), scale=1.0,
            initial_state=states, output_final_state=True, cu_seqlens=cuts.to(q.device, non_blocking=True),
        )  # fmt: skip
        return o[0].float(), final.float()

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, final = self.recurrent(
            *(x[:, None].to(self.dtype) for x in (q, k, v)), g[:, None], beta[:, None].to(self.dtype),
            scale=1.0, initial_state=states, output_final_state=True,
        )  # fmt: skip
        return o[:, 0].float(), final.float()


def fla_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flash-linear-attention's kernels cannot run here (None: they can)."""
    if device.type != "cuda":
        return "flash-linear-attention needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-linear-attention has no {str(dtype).removeprefix('torch.')} kernels"
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:  # ImportError, or a Triton that does not load
        return f"fla does not import ({type(e).__name__}: {e}); pip install fla-core"
    return None


def make_delta_rule(name: str, dtype: torch.dtype, fla: ModuleType | None = None) -> DeltaRule:
    if name == "torch":
        return TorchDeltaRule()
    if name == "fla":
        return FlaDeltaRule(dtype, fla)
    raise ValueError(f"unknown linear-attention kernels {name!r}; choose {' or '.join(LINEAR_KERNELS)}")
