"""The mixture-of-experts block: what a sparse layer of Qwen3-MoE, Qwen2-MoE or Mixtral has instead
of the dense MLP (model/llama.py ``feed_forward`` puts it on ``MoEConfig.sparse_layers``).

Module names mirror Hugging Face's so the checkpoint's tensors load by name: ``gate`` is the router
``[E, H]``, ``shared_expert`` / ``shared_expert_gate`` are Qwen2-MoE's, and ``experts`` holds every
routed expert's weights stacked in two tensors, HF's fused layout (``gate_up_proj`` ``[E, 2I, H]``:
gate rows then up rows; ``down_proj`` ``[E, H, I]``). Checkpoints store each expert's matrices
apart; the loader stacks them into these (model/expert_weights.py): two tensors a layer, not
hundreds of modules, and what a grouped GEMM reads. With FP8 experts (model/quant/) the loader swaps
``experts`` for an ``Fp8Experts`` (the same two stacks, FP8 with their scales); the MoE op takes
either.

Tensor parallelism: the router is whole on every rank (all ranks route alike); each expert's and
the shared expert's MLP columns are split as the dense MLP's are, so every rank computes a partial
sum of the block's output, and one all-reduce adds them (the shared expert's sigmoid gate is a
per-token scalar, so it scales the partial sums as it would the whole).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.scheduler.model.moe_config import MoEConfig
from radixserve.scheduler.model.ops import Ops
from radixserve.scheduler.model.parallel import TPGroup
from radixserve.scheduler.model.quant.linear import Fp8Experts


class Experts(nn.Module):
    """One layer's routed experts, stacked (this rank's ``intermediate`` columns of each)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoE(nn.Module):
    def __init__(
        self, hidden: int, moe: MoEConfig, tp: TPGroup | None = None, shared_expert: nn.Module | None = None
    ) -> None:
        """``moe``: this rank's (``ShardLayout.local_config``); ``shared_expert``: a dense MLP of this
        rank's columns that does not all-reduce its own output (this block does, once)."""
        super().__init__()
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts: Experts | Fp8Experts = Experts(moe.num_experts, hidden, moe.intermediate_size)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.top_k, self.renormalize, self.tp = moe.top_k, moe.renormalize, tp

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        e = self.experts
        y = ops.moe(x, self.gate(x), e.gate_up_proj, e.down_proj, self.top_k, self.renormalize)
        if self.shared_expert is not None:
            shared: torch.Tensor = self.shared_expert(x, ops)
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return y if self.tp is None else self.tp.all_reduce(y)
