"""Scheduler handles and prompts of whole blocks for the router's tests."""

from __future__ import annotations

from radixserve.common.block_hash import block_hashes
from radixserve.common.rpc import pb
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle

MODEL = "m"


BS = 16


def pod(address: str, waiting: int = 0, running: int = 0, outstanding: int = 0) -> SchedulerHandle:
    h = SchedulerHandle(address, healthy=True, load=pb.Load(waiting=waiting, running=running))
    h.outstanding = {f"{address}-r{i}" for i in range(outstanding)}
    return h


def set_load(h: SchedulerHandle, waiting: int = 0, running: int = 0) -> None:
    h.load = pb.Load(waiting=waiting, running=running)


def tokens(seed: int, blocks: int, tail: int = 5) -> list[int]:
    """``blocks`` full blocks (different seeds share none) and a partial block."""
    return [seed * 100_000 + i for i in range(blocks * BS + tail)]


def hashes_of(ids: list[int]) -> list[int]:
    return block_hashes(ids, MODEL, BS)
