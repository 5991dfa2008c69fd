"""Where requests went: a Watch stream (with KV block events) per pod, the hashes that identify a
request or a tenant's prefix, and what that says about each pod's share of the traffic."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence
from typing import Any

import _common as common


class Attribution:
    """Which hash means what: a request's last full prompt block (unique to it) and a tenant's last
    full prefix block (the tenant's whole prefix, since hashes chain)."""

    def __init__(self, wl: dict, block_size: int) -> None:
        from radixserve.common.block_hash import block_hashes

        self.request_of: dict[int, int] = {}
        self.tenant_of: dict[int, int] = {}
        for k, p in enumerate(wl["prefixes"]):
            hs = block_hashes(p, common.MODEL_NAME, block_size)
            if hs:
                self.tenant_of[hs[-1]] = k
        for i, r in enumerate(wl["requests"]):
            hs = block_hashes(r["input_ids"], common.MODEL_NAME, block_size)
            if len(hs) > r["prefix_len"] // block_size:  # a block that includes suffix tokens
                self.request_of[hs[-1]] = i
        self.unattributable = len(wl["requests"]) - len(self.request_of)


class PodMonitor:
    """A Watch stream (with KV block events) per pod, as the gateway's in-memory index has, each read
    by its own thread: feeds an InMemoryPrefixIndex, samples each pod's load, and attributes
    requests and prefixes to pods."""

    def __init__(self, addresses: Sequence[str], attribution: Attribution, interval_s: float = 0.2) -> None:
        from radixserve.common.prefix_index import InMemoryPrefixIndex

        self.addresses = list(addresses)
        self.attr = attribution
        self.interval_s = interval_s
        self.index = InMemoryPrefixIndex()
        self.samples: dict[str, list[tuple[float, Any]]] = {a: [] for a in addresses}  # (t, pb.Load)
        self.pod_of_request: dict[int, str] = {}
        self.prefix_stored: dict[tuple[int, str], int] = {}  # (tenant, pod) -> times stored
        self.prefix_removed: dict[tuple[int, str], int] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._calls: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._channels: list[Any] = []
        self._stopping = False
        self.t0 = 0.0

    def start(self, t0: float) -> None:
        import grpc

        from radixserve.common.rpc import CHANNEL_OPTIONS, pb, pb_grpc

        self.t0 = t0
        for a in self.addresses:
            ch = grpc.insecure_channel(a, options=CHANNEL_OPTIONS)
            call = pb_grpc.SchedulerStub(ch).Watch(
                pb.WatchRequest(interval_s=self.interval_s, kv_events=True)
            )
            self._channels.append(ch)
            self._calls.append(call)
            th = threading.Thread(target=self._read, args=(a, call), name=f"watch-{a}", daemon=True)
            th.start()
            self._threads.append(th)

    def _read(self, address: str, call: Any) -> None:
        import grpc

        try:
            for u in call:
                now = time.perf_counter() - self.t0
                stored, removed = list(u.stored), list(u.removed)
                with self._lock:
                    self.samples[address].append((now, u.load))
                    self.index.apply(address, stored, removed, u.cleared, list(u.tiers), u.load.disk_location)
                    for hs, seen in ((stored, self.prefix_stored), (removed, self.prefix_removed)):
                        for h in hs:
                            i = self.attr.request_of.get(h)
                            if i is not None:
                                self.pod_of_request.setdefault(i, address)
                            k = self.attr.tenant_of.get(h)
                            if k is not None:
                                seen[(k, address)] = seen.get((k, address), 0) + 1
        except grpc.RpcError as e:
            if not self._stopping:
                self.errors.append(f"{address}: {e.code().name} {e.details()}")

    def stop(self) -> None:
        self._stopping = True
        for call in self._calls:
            call.cancel()
        for th in self._threads:
            th.join(5)
        for ch in self._channels:
            ch.close()

    def load_at(self, address: str, t: float) -> Any:
        """The pod's last load sample at or before ``t`` (s from the start), else its first."""
        s = self.samples[address]
        if not s:
            return None
        i = bisect.bisect_right([x[0] for x in s], t) - 1
        return s[max(0, i)][1]

    def summary(self, wl: dict, makespan: float, cached: Sequence[int] | None = None) -> dict:
        reqs = wl["requests"]
        pods = self.addresses
        per_pod = {p: 0 for p in pods}
        pods_of_tenant: dict[int, set[str]] = {}
        for i, p in self.pod_of_request.items():
            per_pod[p] += 1
            pods_of_tenant.setdefault(reqs[i]["tenant"], set()).add(p)
        tenants_of_pod = {p: sorted(k for k, ps in pods_of_tenant.items() if p in ps) for p in pods}
        load = {}
        for p in pods:
            busy = [s.waiting + s.running for t, s in self.samples[p] if t <= makespan]
            kv = [s.kv_used_tokens + s.kv_cached_tokens for t, s in self.samples[p] if t <= makespan]
            cap = self.samples[p][-1][1].kv_capacity_tokens if self.samples[p] else 0
            load[p] = {
                "busy_mean": sum(busy) / len(busy) if busy else None,
                "busy_max": max(busy, default=None),
                "kv_used_or_cached_mean": sum(kv) / len(kv) if kv else None,
                "kv_capacity_tokens": cap,
                "samples": len(busy),
            }
        spread = [len(v) for v in pods_of_tenant.values()]
        # Placement: the pod each tenant's first request went to, and how many prefix tokens that puts
        # on each pod (against its KV capacity); moves: a tenant's request served by another pod than
        # its previous one; re-misses: a tenant's later request that found none of its prefix cached.
        plen = [len(x) for x in wl["prefixes"]]
        first_pod: dict[int, str] = {}
        last_pod: dict[int, str] = {}
        moves = re_misses = 0
        seen: set[int] = set()
        for i, r in enumerate(reqs):
            k, pod = r["tenant"], self.pod_of_request.get(i)
            if k in seen and cached is not None and cached[i] == 0:
                re_misses += 1
            seen.add(k)
            if pod is None:
                continue
            first_pod.setdefault(k, pod)
            if k in last_pod and last_pod[k] != pod:
                moves += 1
            last_pod[k] = pod
        initial = {p: sorted(k for k, q in first_pod.items() if q == p) for p in pods}
        return {
            "attributed_requests": len(self.pod_of_request),
            "requests_per_pod": [per_pod[p] for p in pods],
            "pods_per_tenant": {str(k): len(v) for k, v in sorted(pods_of_tenant.items())},
            "pods_per_tenant_mean": sum(spread) / len(spread) if spread else None,
            "tenants_per_pod": [len(tenants_of_pod[p]) for p in pods],
            "initial_tenants_per_pod": [initial[p] for p in pods],
            "initial_prefix_tokens_per_pod": [sum(plen[k] for k in initial[p]) for p in pods],
            "tenant_moves": moves,
            "later_requests_with_no_cache_hit": re_misses,
            "prefix_prefills": sum(self.prefix_stored.values()),
            "prefix_evictions": sum(self.prefix_removed.values()),
            "pod_load": [load[p] for p in pods],
            "watch_errors": self.errors,
        }
