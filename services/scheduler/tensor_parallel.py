"""Tensor parallelism across processes: rank 0 is the scheduler, ranks 1..N-1 only run the model.

    rank 0 (the scheduler's process)             rank r (a follower process this module starts)
    BatchScheduler -> ModelRunner.plan(batch)
        StepPlan, pickled once --pipe per rank-->  ModelRunner.load(plan) + forward
    ModelRunner.load + forward  <--torch.distributed (NCCL on CUDA, gloo on CPU)-->  every layer's
        samples, broadcasts the tokens            all-reduces, the logits' all-gather, the tokens

The scheduler, its radix cache, policies and retraction exist once, on rank 0. Each step costs one
message per follower over a pipe (the plan: a few int arrays, the ReqToTokenPool writes since the
last step); the model's collectives go through the process group. A pipe rather than a broadcast
on the group: an idle server sends nothing, and a collective waiting for the next step would time
out; and a follower learns that rank 0 is gone from the pipe's end of file.

The KV tiers: every rank holds its own heads' host pool, and the step's copies travel in the plan.
The disk tier's step ops (memory/disk_tier.py) go to each follower before the plan that names them
(``send_step``: ``RankDiskOps``, its heads of the fills: one message per follower, not one for all);
the graceful stop's write-down runs copies without a step (``send_copies``: ``KVCopies``).

Start-up (``start_followers`` then ``TPFollowers``' calls, in this order):

1. rank 0 starts the followers (``python -m radixserve.scheduler.tensor_parallel FD``: a fresh
   interpreter that inherits one end of a socket pair, and neither the parent's threads nor its
   ``__main__``, so a script without a main guard or a notebook can use ``Engine(tp_size=N)``);
   all ranks join the process group (``init_group``; TCP rendezvous on loopback);
2. every rank loads its shard (model/loader.py) and measures what memory its KV pool can have;
   followers report it (``Loaded``), rank 0 takes the smallest: every rank has the same slots;
3. rank 0 builds its scheduler and runner and sends the pool's shape (``RunnerSpec``); the
   followers build theirs, then capture decode graphs when rank 0 does (CUDA; all ranks in step).

Failure: a follower that dies is seen at once (``watch``: its process sentinel), and a collective
that waits on a hung rank fails after ``tp_timeout`` seconds; either way rank 0's engine stops and
its requests end with an error (worker.py), and the scheduler process exits non-zero. Followers
ignore SIGINT/SIGTERM (rank 0 drains and then stops them), die with rank 0 (PDEATHSIG, and the
pipe's end of file), and exit non-zero on any error of their own.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import numpy as np
import torch
import torch.distributed as dist

from radixserve.common import zygote
from radixserve.common.child import die_with_parent
from radixserve.common.ports import free_port
from radixserve.common.zygote import ChildProcess, ForkedProcess
from radixserve.scheduler.memory.allocator import kv_capacity
from radixserve.scheduler.memory.disk_follower import DiskFollower
from radixserve.scheduler.memory.disk_tier import DiskTier, RankDiskOps
from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
from radixserve.scheduler.memory.tiered_cache import KVTransfers
from radixserve.scheduler.model.config import ModelConfig
from radixserve.scheduler.model.device import DeviceProfile
from radixserve.scheduler.model.loader import load_model
from radixserve.scheduler.model.parallel import ShardLayout, TPGroup
from radixserve.scheduler.model.runner import ModelRunner, StepPlan

log = logging.getLogger(__name__)


class TPFailure(RuntimeError):
    """A tensor-parallel rank failed or went away."""


# --------------------------------------------------------------------------- messages
@dataclass(frozen=True, slots=True)
class FollowerSpec:
    """What a follower needs to load its shard (sent as the process's argument)."""

    rank: int
    size: int
    port: int  # the rendezvous (rank 0's TCPStore on loopback)
    model_path: str
    model_config: ModelConfig  # the whole model's, in the dtype served
    profile: DeviceProfile  # rank 0's, with this rank's device
    max_positions: int
    mem_fraction: float
    page_size: int
    timeout_s: float
    torch_threads: int
    parent_pid: int


@dataclass(frozen=True, slots=True)
class Loaded:
    rank: int
    kv_tokens: int  # KV tokens this rank's memory holds after its weights
    weight_bytes: int


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """The shape of rank 0's pools, which every rank's must match slot for slot."""

    pool_slots: int
    table_rows: int  # ReqToTokenPool rows
    max_context: int
    max_batch: int
    page_size: int
    state_snapshots: int = 0  # a hybrid model's prefix snapshots (the StatePool's size)
    host_kv_slots: int = 0  # the host KV tier's slots (each rank holds its own heads' HostKVPool)
    disk_dir: str = ""  # the disk KV tier's directory ("": none); each rank writes its own parts
    host_state_snapshots: int = 0  # a hybrid's host snapshot slots (each rank its own shard's)


@dataclass(frozen=True, slots=True)
class KVCopies:
    """The KV tiers' copies without a step (the write-down at a graceful stop, memory/write_down.py)."""

    transfers: KVTransfers


CAPTURE = "capture"  # capture the decode graphs now
STOP = "stop"


# ------------------------------------------------------------------------ process group
def rank_device(profile: DeviceProfile, rank: int, size: int) -> torch.device:
    """Rank ``rank``'s device: CUDA ranks take consecutive devices from rank 0's; CPU ranks share it."""
    dev = profile.device
    if dev.type != "cuda":
        return dev
    first = dev.index or 0
    if first + size > torch.cuda.device_count():
        raise ValueError(
            f"tp_size {size} from {dev} needs CUDA devices {first}..{first + size - 1}; "
            f"torch sees {torch.cuda.device_count()}"
        )
    return torch.device("cuda", first + rank)


# How long the ranks may take to join the group: a follower is a fresh interpreter that imports torch
# first (seconds on a loaded node), so a short ``tp_timeout`` meant for collectives must not apply.
JOIN_TIMEOUT_S = 120.0


def init_group(layout: ShardLayout, port: int, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the process group (every rank calls this; it returns once all have). Its collectives
    fail after ``timeout_s``; joining may take up to ``JOIN_TIMEOUT_S`` (or ``timeout_s`` if longer)."""
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=layout.rank,
        world_size=layout.size,
        timeout=timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)),
        device_id=device if device.type == "cuda" else None,
    )
    group = dist.new_group(list(range(layout.size)), timeout=timedelta(seconds=timeout_s))
    return TPGroup(layout, group)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------------------- rank 0
class TPFollowers:
    """Rank 0's handle on ranks 1..N-1: their pipes and processes."""

    def __init__(self, procs: list[ChildProcess], conns: list[Connection]) -> None:
        self.procs, self.conns = procs, conns
        self.sentinels = [_exit_sentinel(p) for p in procs]  # readable once the process exits
        self.closing = False
        self.disk: DiskTier | None = None  # rank 0's disk tier: its step ops go to the followers
        self._watcher: threading.Thread | None = None

    def _recv(self, i: int) -> object:
        """Follower ``i``'s next message; raises TPFailure if it died or reported an error."""
        conn, proc = self.conns[i], self.procs[i]
        wait([conn, self.sentinels[i]])
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            code = proc.wait(5)
            raise TPFailure(f"tensor-parallel rank {i + 1} exited (code {code})") from None
        if isinstance(msg, TPFailure):
            raise msg
        return msg

    def loaded(self) -> list[Loaded]:
        return [self._recv(i) for i in range(len(self.conns))]  # type: ignore[misc]

    def build(self, spec: RunnerSpec) -> None:
        self.send(spec)
        for i in range(len(self.conns)):
            self._recv(i)  # "built": a follower that cannot build its runner fails the start-up here

    def capture(self) -> None:
        self.send(CAPTURE)

    def send(self, msg: object) -> None:
        """A message to every follower, pickled once (the runner's step sink: each step's plan)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:  # BrokenPipeError: a follower is gone
            raise TPFailure(f"a tensor-parallel rank is gone: {e!r}") from e

    def send_step(self, plan: StepPlan) -> None:
        """The runner's step sink: the step's disk ops to each follower (its own heads), then the plan."""
        self._send_disk_ops(plan.arrays.get("kv_disk_seq"))
        self.send(plan)

    def send_copies(self, transfers: KVTransfers) -> None:
        """Copies every follower runs now, outside a step (the write-down at a graceful stop)."""
        self._send_disk_ops(transfers.disk_seq)
        self.send(KVCopies(transfers))

    def _send_disk_ops(self, seq: object) -> None:
        if self.disk is None or not isinstance(seq, np.ndarray) or not len(seq):
            return
        try:
            for conn, ops in zip(self.conns, self.disk.follower_ops(int(seq[0])), strict=True):
                conn.send_bytes(pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as e:
            raise TPFailure(f"a tensor-parallel rank is gone: {e!r}") from e

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call ``on_failure(reason)`` (once, on a thread) when a follower exits before ``close``."""

        def run() -> None:
            with contextlib.suppress(OSError, ValueError):  # close() closed the handles first
                wait(self.sentinels)
            if not self.closing:
                on_failure(self.dead() or "a tensor-parallel rank exited")

        self._watcher = threading.Thread(target=run, name="tp-watch", daemon=True)
        self._watcher.start()

    def dead(self, wait_s: float = 0.0) -> str | None:
        """What happened to the first follower that exited, if one did; ``wait_s``: how long to keep
        looking (a collective can fail on the closed connection before the dead process is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    return (
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}; "
                        "the model cannot run without it"
                    )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every follower (STOP, then SIGKILL for one that does not exit in time)."""
        self.closing = True
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(STOP))
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for conn in self.conns:
            conn.close()
        for fd in self.sentinels:
            os.close(fd)
        self.sentinels = []
        if dist.is_initialized():  # rank 0's group: one tensor-parallel engine per process at a time
            dist.destroy_process_group()


def _exit_sentinel(proc: ChildProcess) -> int:
    """An fd readable once ``proc`` has exited: its pidfd (ours, or the zygote's for a fork)."""
    if isinstance(proc, ForkedProcess):
        return proc.exit_fd()
    return os.pidfd_open(proc.pid)  # our child, not waited for yet: its pid is still its own


def start_followers(
    model_path: str,
    model_config: ModelConfig,
    profile: DeviceProfile,
    max_positions: int,
    *,
    size: int,
    mem_fraction: float,
    page_size: int,
    timeout_s: float,
) -> tuple[TPFollowers, TPGroup]:
    """Spawn ranks 1..size-1 and join the group as rank 0; returns the followers and rank 0's group."""
    rank_device(profile, size - 1, size)  # enough devices for every rank, before starting any
    port = free_port()
    procs: list[ChildProcess] = []
    conns: list[Connection] = []
    for rank in range(1, size):
        ours, theirs = mp.Pipe(duplex=True)
        fd = theirs.fileno()
        # Forked by this process's zygote when it has one (a process that starts many engines:
        # the tests); else its own interpreter, in our process group (a scheduler's ranks go with it).
        proc = zygote.spawn(
            ["radixserve.scheduler.tensor_parallel", str(fd)], os.environ, pass_fds=(fd,),
            new_session=False, zygote=zygote.running(),
        )  # fmt: skip
        theirs.close()
        spec = FollowerSpec(
            rank=rank, size=size, port=port, model_path=model_path, model_config=model_config,
            profile=replace(profile, device=rank_device(profile, rank, size)), max_positions=max_positions,
            mem_fraction=mem_fraction, page_size=page_size, timeout_s=timeout_s,
            torch_threads=torch.get_num_threads(), parent_pid=zygote.parent_pid(proc),
        )  # fmt: skip
        procs.append(proc)
        ours.send(spec)
        conns.append(ours)
    followers = TPFollowers(procs, conns)
    try:
        group = init_group(ShardLayout.of(model_config, 0, size), port, profile.device, timeout_s)
    except BaseException:
        followers.close(1)
        raise
    return followers, group


# -------------------------------------------------------------------------- ranks 1..N-1
def main() -> None:
    """``python -m radixserve.scheduler.tensor_parallel FD``: a follower; FD is its end of the pipe."""
    conn = Connection(int(sys.argv[1]))
    follower_main(conn.recv(), conn)


def follower_main(spec: FollowerSpec, conn: Connection) -> None:
    """A follower's whole life: join, load, build, then run every step rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # drains, then stops us with STOP
    die_with_parent(spec.parent_pid, signal.SIGKILL)  # SIGTERM is ignored: rank 0's end kills us
    fmt = f"%(asctime)s tp-rank-{spec.rank} %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    try:
        _serve(spec, conn)
    except BaseException as e:  # rank 0 needs the reason; then this process exits 1
        log.error("tensor-parallel rank %d failed: %s", spec.rank, traceback.format_exc())
        with contextlib.suppress(OSError):
            conn.send(TPFailure(f"tensor-parallel rank {spec.rank} failed: {e!r}"))
        os._exit(1)
    os._exit(0)  # skip interpreter teardown (the process group's threads)


def _serve(spec: FollowerSpec, conn: Connection) -> None:
    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    dev = spec.profile.device
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    layout = ShardLayout.of(spec.model_config, spec.rank, spec.size)
    group = init_group(layout, spec.port, dev, spec.timeout_s)
    model = load_model(spec.model_path, spec.model_config, dev, spec.max_positions, tp=group)
    per_token = model.local_config.kv_bytes_per_token()
    tokens = kv_capacity(dev, per_token, spec.mem_fraction, spec.page_size, ranks_sharing_host=spec.size)
    conn.send(Loaded(spec.rank, tokens, weight_bytes(model)))
    shape = conn.recv_bytes()
    rs: RunnerSpec = pickle.loads(shape)
    table = ReqToTokenPool(rs.table_rows, rs.max_context)
    runner = ModelRunner(
        model, table, rs.pool_slots, rs.max_batch, spec.profile, page_size=rs.page_size,
        state_snapshots=rs.state_snapshots, host_kv_slots=rs.host_kv_slots,
        host_state_snapshots=rs.host_state_snapshots,
    )  # fmt: skip
    disk = DiskFollower(rs.disk_dir, spec.rank, spec.size) if rs.disk_dir else None
    if runner.host_pool is not None:
        runner.host_pool.disk = disk
    conn.send("built")
    try:
        _steps(conn, runner, disk)
    finally:
        if disk is not None:
            disk.close()  # its queued writes land first (a stop's write-down included)


def _steps(conn: Connection, runner: ModelRunner, disk: DiskFollower | None) -> None:
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            raise TPFailure("rank 0 closed the pipe") from None
        if isinstance(msg, StepPlan):
            runner.forward(runner.load(msg))
        elif isinstance(msg, RankDiskOps):
            assert disk is not None, "disk-tier ops without a disk tier"
            disk.stage(msg)
        elif isinstance(msg, KVCopies):
            assert runner.host_pool is not None and disk is not None, "KV copies without the tiers"
            runner.host_pool.run(runner.kv_pool, msg.transfers)
            disk.flush()  # written before the next chunk's: the writer's backlog drops none
        elif msg == CAPTURE:
            runner.capture_graphs()
        elif msg == STOP:
            dist.destroy_process_group()
            return
        else:
            raise TPFailure(f"unexpected message {type(msg).__name__}")


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: the messages pickled both ways must
    # name radixserve.scheduler.tensor_parallel's classes.
    from radixserve.scheduler.tensor_parallel import main as follower

    follower()
