"""StatePool: the recurrent states of a hybrid model's linear-attention layers, indexed by state slot.

Per linear layer, two tensors with one row per slot: the causal convolution's state
``[slots, conv_dim, K - 1]`` in the model's dtype and the delta rule's state
``[slots, value_heads, Dk, Dv]`` in float32 (it accumulates every token of the context: rounding it
to 16 bits each step drifts). The slots, laid out once:

    0 .. R-1        one per ReqToTokenPool row: a running request's working state is its row's slot
    R               the scratch row's (padding rows of a padded decode batch write it; no one reads it)
    R + 1           all zeros, never written: a request without a cached prefix starts by copying it
    R + 2 ..        prefix snapshots held by radix-tree nodes (memory/hybrid_cache.py)

So a request needs no state allocation of its own: holding a table row is holding a state, and
whatever frees the row (finish, abort, retraction) frees the state. The scheduler decides every
copy between slots on the host (memory/states.py ``StatePlan``); the runner runs them on the
device before the step, in stream order, and the layers write snapshots during the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def zero_slot(table_rows: int) -> int:
    """The all-zeros slot of a pool beside a ReqToTokenPool of ``table_rows`` rows (scratch excluded)."""
    return table_rows + 1


def first_snapshot_slot(table_rows: int) -> int:
    return table_rows + 2


@dataclass(frozen=True, slots=True)
class StateShape:
    """One slot's shape on this rank (model/hybrid_config.py ``HybridConfig.state_shape``)."""

    layers: int  # linear-attention layers
    conv_dim: int
    conv_width: int  # K - 1: the inputs a convolution window needs before its token
    heads: int  # value heads
    k_dim: int
    v_dim: int

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one slot: every layer's conv state (model dtype) and delta state (float32)."""
        return self.layers * (
            self.conv_dim * self.conv_width * dtype.itemsize + self.heads * self.k_dim * self.v_dim * 4
        )


class StatePool:
    def __init__(
        self, shape: StateShape, table_rows: int, snapshots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """``table_rows``: the ReqToTokenPool's rows (scratch excluded); ``snapshots``: prefix snapshots."""
        self.num_slots = first_snapshot_slot(table_rows) + snapshots
        conv = (self.num_slots, shape.conv_dim, shape.conv_width)
        self.conv = [torch.zeros(conv, dtype=dtype, device=device) for _ in range(shape.layers)]
        delta = (self.num_slots, shape.heads, shape.k_dim, shape.v_dim)
        self.delta = [torch.zeros(delta, dtype=torch.float32, device=device) for _ in range(shape.layers)]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots ``dst`` take the states of slots ``src`` in every layer (distinct ``dst``; int64)."""
        for conv, delta in zip(self.conv, self.delta, strict=True):
            conv.index_copy_(0, dst, conv.index_select(0, src))
            delta.index_copy_(0, dst, delta.index_select(0, src))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.delta))


SNAPSHOT_SHARE = 0.1  # of the pool memory, for prefix snapshots when not given
SNAPSHOTS_PER_ROW = 4  # ... and at most this many per running request
# Of the host tier's memory, for snapshots when not given: a host prefix of a hybrid model can be
# resumed only at a snapshot, and a snapshot only with its prefix's KV, so neither half is worth
# much without the other (a snapshot of a large hybrid weighs as much as thousands of KV tokens).
HOST_SNAPSHOT_SHARE = 0.5


def plan_host_states(
    shape: StateShape, dtype: torch.dtype, host_bytes: int, snapshots: int | None = None
) -> tuple[int, int]:
    """The host tier's state snapshot slots out of its ``host_bytes`` (memory/host_state_pool.py), and
    the bytes they take. ``snapshots`` None: what ``HOST_SNAPSHOT_SHARE`` of the memory holds."""
    per_slot = shape.nbytes(dtype)
    if snapshots is None:
        snapshots = int(host_bytes * HOST_SNAPSHOT_SHARE) // per_slot
    if snapshots * per_slot >= host_bytes:
        raise ValueError(
            f"host_state_snapshots: {snapshots} snapshots take {snapshots * per_slot / 2**20:.1f} MiB "
            f"({per_slot / 2**20:.2f} MiB each), host_kv_cache_gb holds {host_bytes / 2**20:.1f} MiB: "
            "no room is left for KV; lower host_state_snapshots or raise host_kv_cache_gb"
        )
    return snapshots, snapshots * per_slot


def plan_state_memory(
    shape: StateShape,
    dtype: torch.dtype,
    rows: int,
    kv_tokens: int,
    kv_bytes_per_token: int,
    snapshots: int | None = None,
) -> tuple[int, int]:
    """Split memory that would hold ``kv_tokens`` of KV between a hybrid's state pool (one state per
    row, the scratch and zero slots, the snapshots) and the KV pool; returns (snapshot slots, KV
    tokens left). ``snapshots`` None: what ``SNAPSHOT_SHARE`` of the memory holds, at most
    ``SNAPSHOTS_PER_ROW`` per row."""
    per_slot = shape.nbytes(dtype)
    if snapshots is None:
        budget = kv_tokens * kv_bytes_per_token
        snapshots = min(SNAPSHOTS_PER_ROW * rows, int(budget * SNAPSHOT_SHARE) // per_slot)
    states = (first_snapshot_slot(rows) + snapshots) * per_slot
    left = kv_tokens - -(-states // kv_bytes_per_token)
    if left < 1:
        raise ValueError(
            f"the recurrent states of {rows} running requests and {snapshots} snapshots take "
            f"{states / 2**20:.1f} MiB ({per_slot / 2**20:.2f} MiB each): no memory is left for the KV "
            "pool; lower max_running_requests or max_state_snapshots"
        )
    return snapshots, left
