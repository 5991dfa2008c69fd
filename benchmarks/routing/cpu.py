"""Where the cores went: CPU seconds of every process of a cluster (and of this client), from /proc."""

from __future__ import annotations

import os
from typing import Any

import _common as common

from .cluster import RedisServer


def _cpu_seconds(stat_path: str) -> float:
    return common.proc_cpu_seconds(stat_path) or 0.0  # 0: a thread that ended


class CpuMeter:
    """CPU seconds each process of the cluster (and this benchmark's client) used over a window:
    where the machine's cores went besides the engines' forwards. Schedulers are split into their
    busiest thread (the engine's) and the rest (gRPC, KV events, metrics)."""

    def __init__(self, cluster: Any, redis_srv: RedisServer | None) -> None:
        self.pids = {s.name: s.proc.pid for s in cluster.services if s.proc is not None}
        if redis_srv is not None:
            self.pids["redis-server"] = redis_srv.proc.pid
        self.pids["client"] = os.getpid()

    def read(self) -> dict[str, dict[int, float]]:
        out = {}
        for name, pid in self.pids.items():
            tids = os.listdir(f"/proc/{pid}/task")
            out[name] = {int(t): _cpu_seconds(f"/proc/{pid}/task/{t}/stat") for t in tids}
        return out

    @staticmethod
    def used(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, threads in after.items():
            per = [s - before[name].get(tid, 0.0) for tid, s in threads.items()]
            out[name] = round(sum(per), 2)
            if name.startswith("scheduler"):
                out[f"{name}:engine-thread"] = round(max(per), 2)
        return out
