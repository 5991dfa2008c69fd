"""Where a hybrid checkpoint's linear-attention tensors go in our Gated DeltaNet layers, and the
one-line errors for a checkpoint that does not match its config.json.

Our layer (model/linear_attention.py) holds one ``in_proj`` with rows q, k, v, z, b, a. The
checkpoints spell it two ways:

* Qwen3.5 / Qwen3.5-MoE: ``in_proj_qkv`` (rows q, k, v, each head after head), ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``;
* Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba`` grouped per key head: key head h's rows are
  its q, its k, then the v and z of its ``value_heads / key_heads`` value heads (and b then a).

Each checkpoint tensor fills one run of our rows: a rank reads its heads' rows (a contiguous run of
groups for Qwen3-Next) and reorders them in memory. The convolution's channels (q, k, v), ``A_log``
and ``dt_bias`` are cut by heads the same way; ``out_proj`` by columns (it is row-parallel); the
gated norm's weight (one head's width) is whole on every rank.

A tensor whose shape differs from what config.json's linear heads and conv width give, or a layer
whose tensors are of the other kind than ``layer_types`` says, fails at load naming both.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.hybrid_config import FULL, LINEAR, HybridConfig
from radixserve.scheduler.model.parallel import ShardLayout

_LAYER = re.compile(r"model\.layers\.(?P<i>\d+)\.(?P<kind>linear_attn|self_attn)\.(?P<rest>.+)")
Reader = Callable[[Any], torch.Tensor]  # a safetensors slice -> this rank's part, in our row order


@dataclass(frozen=True, slots=True)
class LinearPlacement:
    param: str  # our parameter
    index: tuple[int | slice, ...]  # the rows of it the tensor fills
    shape: tuple[int, ...]  # the checkpoint tensor's whole shape, from config.json
    reader: Reader

    def read(self, name: str, lazy: Any) -> torch.Tensor:
        shape = tuple(lazy.get_shape())
        if shape != self.shape:
            raise ValueError(
                f"{name}: checkpoint shape {shape} != {self.shape} (config.json's linear_* heads and sizes)"
            )
        return self.reader(lazy)


@dataclass(frozen=True, slots=True)
class _Heads:
    """This rank's linear heads: key heads ``k0 .. k0 + nk``, value heads ``v0 .. v0 + nv``."""

    k0: int
    nk: int
    v0: int
    nv: int

    @classmethod
    def of(cls, h: HybridConfig, layout: ShardLayout) -> _Heads:
        nk, nv = h.num_k_heads // layout.size, h.num_v_heads // layout.size
        return cls(layout.rank * nk, nk, layout.rank * nv, nv)


def linear_placement(name: str, cfg: ModelConfig, layout: ShardLayout) -> LinearPlacement | None:
    """Where checkpoint tensor ``name`` goes (``cfg``: the whole model's); None: not a linear-attention
    tensor (the loader's generic path takes it). Raises for a layer of the other kind."""
    h = cfg.hybrid
    m = _LAYER.fullmatch(name) if h is not None else None
    if h is None or m is None:
        return None
    i, kind, rest = int(m["i"]), m["kind"], m["rest"]
    if i < len(h.layer_types) and (h.layer_types[i] == LINEAR) != (kind == "linear_attn"):
        raise ValueError(
            f"{name}: layer {i} is {h.layer_types[i]} in config.json's layer_types, but the checkpoint "
            f"has {LINEAR if kind == 'linear_attn' else FULL} tensors there"
        )
    if kind == "self_attn":
        return None
    ours = f"model.layers.{i}.linear_attn."
    heads = _Heads.of(h, layout)
    spots = _in_proj(h, heads, cfg.hidden_size) | _others(h, heads, cfg.hidden_size)
    spot = spots.get(rest)
    if spot is None:
        return None
    param, index, shape, reader = spot
    return LinearPlacement(ours + param, index, shape, reader)


Spot = tuple[str, tuple[int | slice, ...], tuple[int, ...], Reader]


def _in_proj(h: HybridConfig, r: _Heads, hidden: int) -> dict[str, Spot]:
    """The input projections' spots: q, k, v, z, b, a rows of our ``in_proj`` (this rank's heads)."""
    kd, vd = r.nk * h.k_head_dim, r.nv * h.v_head_dim  # this rank's
    qkv, z_end = 2 * kd + vd, 2 * kd + 2 * vd
    if h.interleaved_qkvz:
        group = h.num_v_heads // h.num_k_heads
        width = 2 * h.k_head_dim + 2 * group * h.v_head_dim  # rows per key head in in_proj_qkvz
        parts = [h.k_head_dim, h.k_head_dim, group * h.v_head_dim, group * h.v_head_dim]
        return {
            "in_proj_qkvz.weight": (
                "in_proj.weight", (slice(0, z_end),), (h.num_k_heads * width, hidden),
                _grouped(r.k0 * width, r.nk, width, parts),
            ),
            "in_proj_ba.weight": (
                "in_proj.weight", (slice(z_end, z_end + 2 * r.nv),), (2 * h.num_v_heads, hidden),
                _grouped(r.k0 * 2 * group, r.nk, 2 * group, [group, group]),
            ),
        }  # fmt: skip
    return {
        "in_proj_qkv.weight": ("in_proj.weight", (slice(0, qkv),), (h.conv_dim, hidden), _qkv_rows(h, r)),
        "in_proj_z.weight": (
            "in_proj.weight", (slice(qkv, z_end),), (h.value_dim, hidden),
            _rows(r.v0 * h.v_head_dim, vd),
        ),
        "in_proj_b.weight": (
            "in_proj.weight", (slice(z_end, z_end + r.nv),), (h.num_v_heads, hidden), _rows(r.v0, r.nv),
        ),
        "in_proj_a.weight": (
            "in_proj.weight", (slice(z_end + r.nv, z_end + 2 * r.nv),), (h.num_v_heads, hidden),
            _rows(r.v0, r.nv),
        ),
    }  # fmt: skip


def _others(h: HybridConfig, r: _Heads, hidden: int) -> dict[str, Spot]:
    vd = r.nv * h.v_head_dim
    whole = (slice(None),)
    return {
        "conv1d.weight": ("conv1d.weight", whole, (h.conv_dim, 1, h.conv_kernel), _qkv_rows(h, r)),
        "A_log": ("A_log", whole, (h.num_v_heads,), _rows(r.v0, r.nv)),
        "dt_bias": ("dt_bias", whole, (h.num_v_heads,), _rows(r.v0, r.nv)),
        "norm.weight": ("norm.weight", whole, (h.v_head_dim,), lambda lazy: lazy[:]),
        "out_proj.weight": (
            "out_proj.weight", whole, (hidden, h.value_dim),
            lambda lazy: lazy[:, r.v0 * h.v_head_dim : r.v0 * h.v_head_dim + vd],
        ),
    }  # fmt: skip


def _rows(start: int, count: int) -> Reader:
    return lambda lazy: lazy[start : start + count]


def _qkv_rows(h: HybridConfig, r: _Heads) -> Reader:
    """This rank's q, k and v rows of a tensor laid out q (all heads), k, v (in_proj_qkv, conv1d)."""
    kd, vd = r.nk * h.k_head_dim, r.nv * h.v_head_dim
    q0, k0, v0 = r.k0 * h.k_head_dim, h.key_dim + r.k0 * h.k_head_dim, 2 * h.key_dim + r.v0 * h.v_head_dim
    return lambda lazy: torch.cat([lazy[q0 : q0 + kd], lazy[k0 : k0 + kd], lazy[v0 : v0 + vd]])


def _grouped(start: int, groups: int, width: int, parts: list[int]) -> Reader:
    """Rows ``start ..`` of ``groups`` groups of ``width`` rows, each group cut into ``parts``,
    regrouped part by part: all groups' first parts, then all second parts, ..."""

    def read(lazy: Any) -> torch.Tensor:
        block = lazy[start : start + groups * width]
        pieces = block.reshape(groups, width, -1).split(parts, dim=1)
        return torch.cat([p.reshape(-1, block.shape[-1]) for p in pieces])

    return read
