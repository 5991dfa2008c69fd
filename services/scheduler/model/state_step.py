"""A hybrid model's per-step state work on the runner's side: the StatePlan (memory/states.py) as
StepPlan arrays (what rank 0 sends every rank), and those arrays, on the device, as the copies run
before the forward and the LinearStep the linear-attention layers read.

Nothing here runs for a model without linear-attention layers.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.scheduler.batch import ScheduleBatch
from radixserve.scheduler.memory.state_pool import StatePool
from radixserve.scheduler.model.linear_attention import LinearStep
from radixserve.scheduler.model.linear_kernels import DeltaRule

NONE = np.zeros(0, dtype=np.int64)


def state_arrays(batch: ScheduleBatch) -> dict[str, np.ndarray]:
    """The batch's StatePlan as flat int64 arrays: copies and inits ``[sources..., destinations...]``,
    cuts as ``[rows..., offsets..., slots...]``."""
    plan = batch.states
    if plan is None:
        return {"state_copies": NONE, "state_inits": NONE, "state_cuts": NONE}
    cuts = [(row, offset, slot) for row, own in enumerate(plan.cuts) for offset, slot in own]
    flat = np.array(cuts, dtype=np.int64).T.reshape(-1) if cuts else NONE
    return {"state_copies": plan.copies, "state_inits": plan.inits, "state_cuts": flat}


def cuts_per_row(flat: np.ndarray, rows: int) -> list[list[tuple[int, int]]]:
    """``state_arrays``' cuts back as (offset, slot) lists, one per batch row."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    row, offset, slot = (a.tolist() for a in np.split(flat, 3)) if len(flat) else ([], [], [])
    for r, o, s in zip(row, offset, slot, strict=True):
        out[r].append((o, s))
    return out


def run_copies(step: LinearStep) -> None:
    """Before the step, in this order: ended requests' states into their snapshots, then admitted
    requests' rows from their snapshot (or the zero slot): a row may go from one to the other."""
    for pairs in (step.copies, step.inits):
        if pairs is not None and len(pairs):
            src, dst = pairs.chunk(2)
            step.pool.copy(src, dst)


def linear_step(
    pool: StatePool,
    rule: DeltaRule,
    dev: list[torch.Tensor],
    host_rows: np.ndarray,
    cuts: np.ndarray,
    prefill: bool,
) -> LinearStep:
    """The LinearStep of one forward from the staged ``[rows, copies, inits]`` (a row's slot is its
    row) and the host's rows and cuts."""
    slots, copies, inits = dev
    if not prefill:
        return LinearStep(pool, rule, slots, copies=copies, inits=inits)
    own = cuts_per_row(cuts, len(host_rows))
    return LinearStep(pool, rule, slots, host_rows.tolist(), own, copies, inits)
