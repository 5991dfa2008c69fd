"""A hybrid model's per-step state work on the runner's side: the StatePlan (memory/states.py) as
StepPlan arrays (what rank 0 sends every rank), and those arrays, on the device, as the copies run
before the forward and the LinearStep the linear-attention layers read.

Nothing here runs for a model without linear-attention layers.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.scheduler.batch import ScheduleBatch
from radixserve.scheduler.memory.host_state_pool import HostStatePool
from radixserve.scheduler.memory.state_pool import StatePool
from radixserve.scheduler.model.linear_attention import LinearStep
from radixserve.scheduler.model.linear_kernels import DeltaRule

NONE = np.zeros(0, dtype=np.int64)
STATE_ARRAYS = ("state_stores", "state_loads", "state_copies", "state_inits", "state_cuts")


def state_arrays(batch: ScheduleBatch) -> dict[str, np.ndarray]:
    """The batch's StatePlan as flat int64 arrays: copies and inits ``[sources..., destinations...]``,
    cuts as ``[rows..., offsets..., slots...]``."""
    plan = batch.states
    if plan is None:
        return dict.fromkeys(STATE_ARRAYS, NONE)
    cuts = [(row, offset, slot) for row, own in enumerate(plan.cuts) for offset, slot in own]
    flat = np.array(cuts, dtype=np.int64).T.reshape(-1) if cuts else NONE
    return {
        "state_stores": plan.stores,  # the host tier's snapshot copies (HostStatePool)
        "state_loads": plan.loads,
        "state_copies": plan.copies,
        "state_inits": plan.inits,
        "state_cuts": flat,
    }


def cuts_per_row(flat: np.ndarray, rows: int) -> list[list[tuple[int, int]]]:
    """``state_arrays``' cuts back as (offset, slot) lists, one per batch row."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    row, offset, slot = (a.tolist() for a in np.split(flat, 3)) if len(flat) else ([], [], [])
    for r, o, s in zip(row, offset, slot, strict=True):
        out[r].append((o, s))
    return out


def run_copies(step: LinearStep, host: HostStatePool | None = None) -> None:
    """Before the step, in this order: snapshots the device pool evicted to their host slots (from
    their slot, or from the row a queued copy would have read), host snapshots back to device slots,
    ended requests' states into their snapshots, then admitted requests' rows from their snapshot
    (or the zero slot): a slot a store reads may be a load's, a copy's or a cut's destination, a
    snapshot a load writes an init's source, a row a copy reads an init's destination."""
    if len(step.stores) or len(step.loads):
        assert host is not None, "state snapshot copies without a host tier"
        host.store(step.pool, step.stores)
        host.load(step.pool, step.loads)
    for pairs in (step.copies, step.inits):
        if pairs is not None and len(pairs):
            src, dst = pairs.chunk(2)
            step.pool.copy(src, dst)


def linear_step(
    pool: StatePool,
    rule: DeltaRule,
    dev: list[torch.Tensor],
    host_rows: np.ndarray,
    arrays: dict[str, np.ndarray],
    prefill: bool,
) -> LinearStep:
    """The LinearStep of one forward from the staged ``[rows, copies, inits]`` (a row's slot is its
    row), the host's rows and the plan's host arrays (cuts; the host tier's stores and loads)."""
    slots, copies, inits = dev
    stores, loads = arrays["state_stores"], arrays["state_loads"]
    if not prefill:
        return LinearStep(pool, rule, slots, copies=copies, inits=inits, stores=stores, loads=loads)
    own = cuts_per_row(arrays["state_cuts"], len(host_rows))
    return LinearStep(pool, rule, slots, host_rows.tolist(), own, copies, inits, stores, loads)
