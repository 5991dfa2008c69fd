"""Where a mixture-of-experts checkpoint's own tensors go in our model (model/moe.py).

``moe_placement(name, cfg, layout)`` says, for a checkpoint tensor, which of our parameters it
fills, which part of that parameter, and which part of the tensor this rank reads; the loader
(model/loader.py) reads and copies. The spellings:

* one tensor per expert, as transformers 5 saves them (its modules hold them fused):
  ``{layer}.mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`` (Qwen) and
  ``{layer}.block_sparse_moe.experts.{e}.w1|w3|w2.weight`` (Mixtral: w1 gate, w3 up, w2 down),
  stacked into ``{layer}.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``.down_proj`` ``[E, H, I]``;
* those two stacked tensors under their own names (HF's fused layout), read whole;
* Mixtral's router ``block_sparse_moe.gate.weight`` (ours ``mlp.gate.weight``). Qwen's router and
  shared-expert gate load by their own names; the shared expert is a dense MLP to the loader
  (``merged_target`` / ``checkpoint_slice``), so FP8 loading sees it as one too.

Under tensor parallelism a rank reads its columns of every expert: rows of gate and up, columns of
down. A tensor's whole shape is checked before any part of it is read, so a wrong shape fails at
load naming the tensor, whatever the rank reads; ``missing_tensor`` names, for a stack left
partly unfilled, the first expert tensor the files lacked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.parallel import ShardLayout

ALL = slice(None)
_PER_EXPERT = re.compile(
    r"(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight"
)
_STACKED = re.compile(r"(?P<layer>.+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)")
PROJECTIONS = {
    "gate": ("gate_proj", "w1"),
    "up": ("up_proj", "w3"),
    "down": ("down_proj", "w2"),
}  # Qwen, Mixtral
ROLES = {proj: role for role, names in PROJECTIONS.items() for proj in names}
STACKS = ("gate_up_proj", "down_proj")  # our experts module's (model/moe.py)


@dataclass(frozen=True, slots=True)
class Placement:
    param: str  # our parameter
    index: tuple[int | slice, ...]  # the part of it the tensor fills (leading dimensions)
    shape: tuple[int, ...]  # the checkpoint tensor's whole shape
    reads: tuple[tuple[slice, ...], ...]  # this rank's parts of the tensor, concatenated along cat_dim
    cat_dim: int = 0

    @property
    def experts(self) -> str | None:
        """Our experts module whose stack this tensor fills (None: not an expert's: Mixtral's router)."""
        module, _, stack = self.param.rpartition(".")
        return module if module.endswith(".mlp.experts") and stack in STACKS else None

    def read(self, name: str, lazy: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` from its safetensors slice ``lazy``."""
        shape = tuple(lazy.get_shape())
        if shape != self.shape:
            raise ValueError(f"{name}: checkpoint shape {shape} != {self.shape}")
        parts: list[torch.Tensor] = [lazy[r] for r in self.reads]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.cat_dim)


def moe_placement(name: str, cfg: ModelConfig, layout: ShardLayout) -> Placement | None:
    """Where checkpoint tensor ``name`` goes (``cfg``: the whole model's); None: not an MoE tensor
    this module places (the loader's generic path takes it, or refuses it as unexpected)."""
    moe = cfg.moe
    if moe is None:
        return None
    hidden, width = cfg.hidden_size, moe.intermediate_size
    start, count = layout.share(width)
    mine = slice(start, start + count)  # this rank's columns of every expert
    if name.endswith(".block_sparse_moe.gate.weight"):
        return Placement(
            name.replace(".block_sparse_moe.", ".mlp."), (), (moe.num_experts, hidden), ((ALL,),)
        )
    if m := _PER_EXPERT.fullmatch(name):
        e, role = int(m["e"]), ROLES.get(m["proj"])
        if role is None or e >= moe.num_experts:
            return None
        stack = f"{m['layer']}.mlp.experts."
        if role == "down":
            return Placement(stack + "down_proj", (e,), (hidden, width), ((ALL, mine),))
        rows = slice(0, count) if role == "gate" else slice(count, 2 * count)
        return Placement(stack + "gate_up_proj", (e, rows), (width, hidden), ((mine,),))
    if m := _STACKED.fullmatch(name):
        if m["proj"] == "down_proj":
            return Placement(name, (), (moe.num_experts, hidden, width), ((ALL, ALL, mine),))
        up = slice(width + start, width + start + count)
        return Placement(name, (), (moe.num_experts, 2 * width, hidden), ((ALL, mine), (ALL, up)), cat_dim=1)
    return None


def missing_tensor(param: str, unfilled: torch.Tensor, arch: str) -> str:
    """What the checkpoint lacked, for our parameter ``param`` with rows ``unfilled`` still empty:
    for an expert stack (an FP8 stack's weight or scales too), the first missing expert's own
    weight; else ``param`` itself."""
    name = param.removesuffix(".weight").removesuffix(".weight_scale")  # an FP8 stack's parts
    for stack, role in ((".mlp.experts.gate_up_proj", "gate"), (".mlp.experts.down_proj", "down")):
        if name.endswith(stack) and unfilled.dim() >= 2:
            e, row = (int(i) for i in unfilled.nonzero()[0][:2])  # rows, or block rows of scales
            if role == "gate" and row >= unfilled.shape[1] // 2:
                role = "up"
            mixtral = arch == "mixtral"
            block, proj = ("block_sparse_moe" if mixtral else "mlp"), PROJECTIONS[role][mixtral]
            return f"{name.removesuffix(stack)}.{block}.experts.{e}.{proj}.weight"
    return param
