"""The Gated DeltaNet layer of the hybrids (Qwen3-Next, Qwen3.5): linear attention over a recurrent
state kept in the StatePool (memory/state_pool.py), one slot per running request.

Per token: one input projection gives q, k, v (through a short causal convolution with SiLU), z
(the output gate), b (write strength ``beta = sigmoid(b)``) and a (decay ``g = -exp(A_log) *
softplus(a + dt_bias)``); the gated delta rule (model/gated_delta.py, or flash-linear-attention's
kernels: model/linear_kernels.py) reads and updates the state; the output is RMS-normalised per
head, multiplied by ``silu(z)`` and projected back.

Checkpoints store the input projection as ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a`` (Qwen3.5) or ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head (Qwen3-Next); ours
is one ``in_proj`` with rows q, k, v, z, b, a (model/linear_weights.py puts them there).

A prefill step may take prefix snapshots (``LinearStep.cuts``): after ``offset`` tokens of a
request's extend, its state (conv and delta) is copied into a snapshot slot. The convolution runs
over the whole extend at once (its state at any offset is a window of the inputs); the delta rule
runs in rounds, round r taking every request's r-th piece between cuts, so each piece starts from
the state the previous one left. Without cuts (most steps) it is one call over the whole batch.

Tensor parallelism: a rank holds its share of the key heads and the value heads that go with them
(q/k/v/z/b/a rows, conv channels, A_log, dt_bias); ``out_proj`` is row-parallel.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.memory.state_pool import StatePool
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.forward_batch import ForwardBatch
from radixserve.scheduler.model.gated_delta import conv_extend, conv_step, l2_normalize
from radixserve.scheduler.model.linear_kernels import DeltaRule
from radixserve.scheduler.model.llama import row_linear
from radixserve.scheduler.model.parallel import TPGroup


@dataclass(slots=True)
class LinearStep:
    """What the linear-attention layers of one forward need besides their input."""

    pool: StatePool
    rule: DeltaRule
    slots: torch.Tensor  # [B] int64 on the device: each row's state slot (padding rows: the scratch's)
    slot_list: list[int] = field(default_factory=list)  # prefill: the same, on the host
    # prefill: per request, (offset in its extend, snapshot slot): after that many of its tokens,
    # copy its state there; offsets ascending in 1..extend_len
    cuts: list[list[tuple[int, int]]] = field(default_factory=list)
    # state copies the runner makes before the step ([sources..., destinations...], on the device):
    # ended requests' states into snapshots, then admitted requests' rows from theirs
    copies: torch.Tensor | None = None
    inits: torch.Tensor | None = None
    # the host tier's snapshot copies, run first (memory/host_state_pool.py), on the host:
    # ``[state slots..., host slots...]`` and ``[host slots..., device snapshot slots...]``
    stores: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    loads: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, then times ``silu(gate)`` (in float32, as HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_index: int, tp: TPGroup | None = None) -> None:
        """``cfg``: this rank's; ``linear_index``: which linear layer (its state pool index)."""
        super().__init__()
        h = cfg.hybrid
        assert h is not None
        self.linear_index = linear_index
        self.nk, self.nv, self.dk, self.dv = h.num_k_heads, h.num_v_heads, h.k_head_dim, h.v_head_dim
        self.splits = [h.key_dim, h.key_dim, h.value_dim, h.value_dim, h.num_v_heads, h.num_v_heads]
        self.in_proj = nn.Linear(cfg.hidden_size, h.in_proj_rows, bias=False)
        self.conv1d = nn.Conv1d(h.conv_dim, h.conv_dim, h.conv_kernel, groups=h.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(h.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(h.num_v_heads))
        self.norm = GatedRMSNorm(h.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = row_linear(h.value_dim, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        step = fb.linear
        assert step is not None, "a hybrid model's step needs its LinearStep"
        t = x.shape[0]
        q, k, v, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        mixed = torch.cat([q, k, v], dim=-1)
        weight = self.conv1d.weight[:, 0]
        decode = fb.mode is ForwardMode.DECODE
        mixed = (
            self._conv_decode(mixed, weight, step) if decode else self._conv_extend(mixed, weight, step, fb)
        )
        q, k, v = torch.split(mixed, self.splits[:3], dim=-1)
        group = self.nv // self.nk  # value heads per key head
        q = (l2_normalize(q.reshape(t, self.nk, self.dk)) * self.dk**-0.5).repeat_interleave(group, dim=1)
        k = l2_normalize(k.reshape(t, self.nk, self.dk)).repeat_interleave(group, dim=1)
        v32 = v.reshape(t, self.nv, self.dv).float()
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if decode:
            out = self._delta_decode(q, k, v32, g, beta, step)
        else:
            out = self._delta_extend(q, k, v32, g, beta, step, fb.extend_lens.tolist())
        out = self.norm(out.to(x.dtype), z.reshape(t, self.nv, self.dv))
        y: torch.Tensor = self.out_proj(out.reshape(t, -1))
        return y

    # ------------------------------------------------------------------ convolution
    def _conv_decode(self, x: torch.Tensor, weight: torch.Tensor, step: LinearStep) -> torch.Tensor:
        pool = step.pool.conv[self.linear_index]
        y, state = conv_step(x, pool.index_select(0, step.slots), weight)
        pool.index_copy_(0, step.slots, state.to(pool.dtype))
        return y

    def _conv_extend(
        self, x: torch.Tensor, weight: torch.Tensor, step: LinearStep, fb: ForwardBatch
    ) -> torch.Tensor:
        pool = step.pool.conv[self.linear_index]
        width = pool.shape[-1]
        out = torch.empty_like(x)
        start = 0
        for slot, n, cuts in zip(step.slot_list, fb.extend_lens.tolist(), step.cuts, strict=True):
            out[start : start + n], padded = conv_extend(x[start : start + n], pool[slot], weight)
            for offset, dst in cuts:  # the state after ``offset`` tokens: the inputs just before
                pool[dst] = padded[:, offset : offset + width]
            pool[slot] = padded[:, n : n + width]
            start += n
        return out

    # ------------------------------------------------------------------ delta rule
    def _delta_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        step: LinearStep,
    ) -> torch.Tensor:
        pool = step.pool.delta[self.linear_index]
        out, state = step.rule.decode(q, k, v, g, beta, pool.index_select(0, step.slots))
        pool.index_copy_(0, step.slots, state)
        return out

    def _delta_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        step: LinearStep,
        lens: list[int],
    ) -> torch.Tensor:
        pool = step.pool.delta[self.linear_index]
        if not any(step.cuts):  # one round over every request (the usual step)
            slots = step.slots[: len(lens)]
            out, final = step.rule.extend(q, k, v, g, beta, lens, pool.index_select(0, slots))
            pool.index_copy_(0, slots, final)
            return out
        out = torch.empty_like(v)
        for members, index, piece_lens, snapshot in _rounds(step, lens):
            rows = torch.from_numpy(index).to(q.device, non_blocking=True)
            slots = torch.tensor(members, dtype=torch.int64).to(q.device, non_blocking=True)
            qr, kr, vr, gr, br = (x.index_select(0, rows) for x in (q, k, v, g, beta))
            part, final = step.rule.extend(qr, kr, vr, gr, br, piece_lens, pool.index_select(0, slots))
            out.index_copy_(0, rows, part)
            pool.index_copy_(0, slots, final)
            for j, dst in snapshot:
                pool[dst] = final[j]
        return out


def _rounds(
    step: LinearStep, lens: list[int]
) -> list[tuple[list[int], np.ndarray, list[int], list[tuple[int, int]]]]:
    """The delta rule's rounds for a step with cuts: per round, the state slots of the requests
    with a piece in it, their pieces' token indices (packed), the pieces' lengths, and which of them
    end at a snapshot (index in the round, snapshot slot)."""
    pieces: list[list[tuple[int, int, int]]] = []  # per request: (start, end, snapshot slot or -1)
    start = 0
    for n, cuts in zip(lens, step.cuts, strict=True):
        bounds, at = [0], {}
        for offset, dst in cuts:
            if offset > bounds[-1]:
                bounds.append(offset)
            at[offset] = dst
        if bounds[-1] != n:
            bounds.append(n)
        pieces.append([(start + a, start + b, at.get(b, -1)) for a, b in itertools.pairwise(bounds)])
        start += n
    rounds = []
    for r in range(max(len(p) for p in pieces)):
        members: list[int] = []
        index: list[np.ndarray] = []
        piece_lens: list[int] = []
        snapshot: list[tuple[int, int]] = []
        for slot, own in zip(step.slot_list, pieces, strict=True):
            if r < len(own):
                a, b, dst = own[r]
                if dst >= 0:
                    snapshot.append((len(members), dst))
                members.append(slot)
                index.append(np.arange(a, b, dtype=np.int64))
                piece_lens.append(b - a)
        rounds.append((members, np.concatenate(index), piece_lens, snapshot))
    return rounds
