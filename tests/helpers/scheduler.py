"""A model-free stand-in for the model that checks KV ownership on every step, and the scheduler setups
the scheduler tests share."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ScheduleBatch
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.req import Req

VOCAB = 97


class KVEchoRunner:
    """Stands in for the model: writes each fed token into a fake KV pool at its slot.

    Before "sampling", every request's whole context is read back through its
    ReqToTokenPool row and must equal its tokens: a row that points at a freed and
    reused page, or at another request's page, fails here. The next token depends
    only on the sequence, so any engine feature that changes outputs is caught too.

    A hybrid scheduler's recurrent states are faked too: a slot's "state" is the tuple of tokens it
    has seen. The step's state copies run first, then every request's row must hold exactly the
    tokens before its step, its snapshots get the tokens up to their cut, and every snapshot the
    tree holds must be the tokens of its node's path: a snapshot resumed at the wrong prefix fails.
    """

    def __init__(self, scheduler: BatchScheduler) -> None:
        self.s = scheduler
        self.kv = np.full(scheduler.kv.allocator.pool_slots, -1, dtype=np.int64)
        self.futures: dict[int, int] = {}  # FutureMap: placeholder id -> sampled token
        self.states: dict[int, tuple[int, ...]] = {}  # state slot -> the tokens it has seen
        self.host_states: dict[int, tuple[int, ...]] = {}  # host snapshot slot -> the same
        self.snapshots_stored = self.snapshots_loaded = 0  # copies to and from the host snapshots
        self.host: np.ndarray | None = None  # the host KV tier's fake pool
        self.stored = self.loaded = 0  # tokens copied to and from it
        self._loading: tuple[np.ndarray, np.ndarray] | None = None  # loads not landed: (device slots, KV)

    def _states(self, batch: ScheduleBatch) -> None:
        plan, cache = batch.states, self.s.kv.cache
        if plan is None:
            return
        # the host tier's snapshot copies first, stores before loads (model/state_step.py run_copies)
        for pairs, src_of, dst_of in (
            (plan.stores, self.states, self.host_states),
            (plan.loads, self.host_states, self.states),
        ):
            src, dst = np.split(pairs, 2)
            for a, b in zip(src.tolist(), dst.tolist(), strict=True):
                dst_of[b] = src_of.get(a, ())
            self.snapshots_stored += len(src) if dst_of is self.host_states else 0
            self.snapshots_loaded += len(src) if dst_of is self.states else 0
        for pairs in (plan.copies, plan.inits):
            src, dst = np.split(pairs, 2)
            for a, b in zip(src.tolist(), dst.tolist(), strict=True):
                self.states[b] = self.states.get(a, ())  # a never-written slot is zeros: the empty prefix
        for slot, node in getattr(cache, "held", {}).items():
            assert self.states.get(slot, ()) == tuple(path_tokens(node)), f"snapshot {slot} is not its node's"
        for slot, node in getattr(cache, "host_held", {}).items():
            if slot not in getattr(cache, "snap_stores", {}):  # (a store queued for the next step)
                assert self.host_states.get(slot) == tuple(path_tokens(node)), f"host snapshot {slot}"
        for i, (req, p, n) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True)):
            seq = tuple(self.resolve(req.fill_ids()[: int(p + n)]).tolist())
            assert self.states.get(req.req_pool_idx, ()) == seq[: int(p)], (
                f"state of {req.rid} is not its prefix"
            )
            for offset, slot in plan.cuts[i] if plan.cuts else ():
                self.states[slot] = seq[: int(p) + offset]
            self.states[req.req_pool_idx] = seq

    def resolve(self, ids: np.ndarray) -> np.ndarray:
        """Placeholders (-1 - future id) become the tokens an earlier forward sampled."""
        ids = np.asarray(ids, dtype=np.int64).copy()
        for i in np.flatnonzero(ids < 0):
            ids[i] = self.futures[int(-1 - ids[i])]
        return ids

    def _transfers(self, batch: ScheduleBatch) -> None:
        """The host tier's copies (write-backs, then loads), as the model runner runs them; loads the
        batch does not wait for (``load_sync`` empty) land only after its forward, as on CUDA, where
        they run beside it: a batch that reads a page its own step loads without waiting fails."""
        self._land_loads()
        t = batch.kv_transfers
        if t is None:
            return
        host = self.s.kv.host
        assert host is not None, "host-tier copies without a host tier"
        if self.host is None:  # a tensor, for the disk tier's captures and fills (a block is [1, bs, 1, 1])
            self.host_tensor = torch.full((host.pool_slots, 1, 1), -1, dtype=torch.int64)
            self.host = self.host_tensor.numpy().reshape(-1)
        if len(t.disk_seq):  # the disk tier's captures, then fills, as HostKVPool runs them
            self.s.kv.cache.disk.run_step(int(t.disk_seq[0]), [self.host_tensor])
        self.host[t.store_dst] = self.kv[t.store_src]
        self.kv[t.load_dst] = -2  # being loaded: a forward that reads it before it lands fails
        self._loading = (t.load_dst, self.host[t.load_src].copy())
        if len(t.load_sync):
            self._land_loads()
        self.stored += len(t.store_dst)
        self.loaded += len(t.load_dst)

    def _land_loads(self) -> None:
        """The last step's loads land (before the next forward: it waits for them)."""
        if self._loading is not None:
            dst, kv = self._loading
            self._loading = None
            self.kv[dst] = kv

    def forward(self, batch: ScheduleBatch) -> list[int]:
        self._transfers(batch)
        self.kv[batch.out_slots] = self.resolve(batch.input_ids)
        self._states(batch)
        out = []
        for i, (req, p, n) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True)):
            end = int(p + n)
            row = self.s.kv.req_to_token.host[req.req_pool_idx, :end]
            expect = self.resolve(req.fill_ids()[:end])
            np.testing.assert_array_equal(self.kv[row], expect, err_msg=f"KV of {req.rid} is corrupt")
            tok = next_token(expect)
            if batch.future_ids[i] >= 0:
                self.futures[int(batch.future_ids[i])] = tok
            out.append(tok)
        return out


def path_tokens(node) -> list[int]:
    """The tokens from the root to the end of ``node``."""
    parts = []
    while node.parent is not None:
        parts.append(node.key.tolist())
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def next_token(seq: np.ndarray) -> int:
    """A deterministic 'model': the next token is a function of the sequence."""
    tail = seq[-4:].astype(np.int64)
    return int((tail * np.array([3, 5, 7, 11][: len(tail)])).sum() + 13 * len(seq)) % VOCAB


def reference_output(prompt: list[int], max_new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new):
        seq.append(next_token(np.asarray(seq)))
    return seq[len(prompt) :]


def runner_for(s: BatchScheduler) -> KVEchoRunner:
    """One fake KV pool per scheduler, for as long as it lives (cached prefixes stay readable)."""
    if not hasattr(s, "_echo_runner"):
        s._echo_runner = KVEchoRunner(s)  # type: ignore[attr-defined]
    return s._echo_runner  # type: ignore[attr-defined]


def run_to_completion(s: BatchScheduler, max_steps: int = 100_000, check: bool = True) -> list[Req]:
    runner = runner_for(s)
    finished: list[Req] = []
    for _ in range(max_steps):
        if s.idle:
            return finished
        batch = s.schedule()
        disk = getattr(s.kv.cache, "disk", None)
        if batch is None and disk is not None and disk.reading:
            disk.flush()  # every request waits for a disk read: wait with them
            continue
        assert batch is not None, "scheduler stalled with work left"
        if check:
            s.kv.check(s.live_requests())
        finished += s.process(batch, runner.forward(batch))
        if check:
            s.kv.check(s.live_requests())
    raise AssertionError("did not finish")


def make_req(rid: str, ids, max_new: int = 8, t: float = 0.0) -> Req:
    return Req(rid, list(ids), SamplingParams(max_new_tokens=max_new), arrival_time=t)


def sched(
    clock=None,
    total=4096,
    page=1,
    rows=64,
    ctx=2048,
    no_cache=False,
    snapshots=None,
    host=0,
    host_snapshots=0,
    write_through=False,
    disk=None,
    **kw,
) -> BatchScheduler:
    """``snapshots``: a hybrid model's scheduler with that many state snapshots (None: a dense one);
    ``host``: tokens of host KV tier (0: none); ``host_snapshots``: its state snapshot slots."""
    mem = MemoryConfig(
        max_total_tokens=total,
        page_size=page,
        max_running_requests=rows,
        max_context_len=ctx,
        disable_radix_cache=no_cache,
        hybrid=snapshots is not None,
        state_snapshots=snapshots or 0,
        host_kv_tokens=host,
        host_state_snapshots=host_snapshots,
        kv_write_through=write_through,
        disk=disk,
    )
    if clock is None:
        return BatchScheduler(SchedulerConfig(memory=mem, **kw))
    return BatchScheduler(SchedulerConfig(memory=mem, **kw), clock=clock)


def step(s: BatchScheduler, runner: KVEchoRunner):
    b = s.schedule()
    assert b is not None
    s.process(b, runner.forward(b))
    return b


SYS = list(range(1, 201))  # a 200-token shared prefix
