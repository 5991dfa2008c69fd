"""Routing across scheduler pods: cache-aware vs least-load vs round-robin, multi-tenant prefixes.

One seeded workload, four configurations, each on a fresh cluster (``launcher.build_cluster``:
gateway + ``--schedulers`` scheduler processes + detokenizer on loopback, every scheduler with
``--threads`` torch threads; on a 2-core machine the pods share the cores, as they would share a
node):

* ``cache-aware``       gateway ``--router cache-aware``, in-memory prefix index (fed by the pods'
                        Watch streams)
* ``least-load``        ``--router least-load``
* ``round-robin``       ``--router round-robin``: the baseline of the ratios
* ``cache-aware+redis`` ``--router cache-aware`` with the Redis prefix index: a ``redis-server`` child
                        (``--save '' --appendonly no``, a free port) that the pods publish their KV
                        block events to and the gateway reads; stopped by pid afterwards

Workload (``--tenants`` T): T system prompts ("tenants"), each ``--prefix-range`` random token ids
long; every request is one tenant's prompt (uniform choice) + a unique random suffix
(``--suffix-range`` tokens), sent as token ids; output ``--output-range`` tokens, greedy,
``ignore_eos``, so every request produces exactly its length (checked). ``--num-requests``
requests, Poisson arrivals (first at t=0), one draw scaled to each of ``--rates`` req/s in turn
(``inf``: all at t=0), so every rate sends the same prompts in the same order. Special ids 0..4 are
avoided.

Rates: on the reference machine (2 CPU cores, small demo model, 1 torch thread per pod) the full
run sweeps 1 req/s (light for both: no queues, so the hit rate is the routing's alone), 4 and 6
req/s (round-robin overloaded, cache-aware near its capacity: the TTFT comparison) and ``inf``
(everything queued at once: output throughput is then each router's capacity, the only rate where
a throughput ratio means more than "served what was offered"). With requests queued, each pod's
``lpm`` policy groups same-tenant requests out of its queue, so round-robin's hit rate rises with
load (0.21 at 1 req/s, 0.35 at 4, 0.49 at 6, 0.69 all at once in the last full run). On other
machines choose ``--rates`` the same way. The full default run takes about 35 minutes there.

KV capacity: every pod gets ``--max-total-tokens`` (default: ``--kv-prefixes`` x the mean prefix
length, page-rounded: room for about that many tenants' prefixes, running requests included). With
the defaults (16 tenants, 4 pods, 5 prefixes per pod) a pod can keep its own quarter of the tenants
(4) plus a little, but nowhere near all 16: a router that sends every tenant everywhere
(round-robin, least-load) makes each pod's cache thrash; one that keeps each tenant on one pod does
not. With unlimited KV every pod would cache every tenant after its first miss and routing would not
matter.

Measured per configuration (from this process, over HTTP: ``POST /v1/completions``, ``stream: true``,
``stream_options.include_usage``; times from the moment a request is sent):

* cache hit rate = sum ``usage.prompt_tokens_details.cached_tokens`` / sum ``usage.prompt_tokens``
  (cached = prompt tokens found in the serving pod's radix cache at admission). For scale, the ideal
  one (every tenant on one pod, never evicted: all its page-aligned prefix tokens hit except on its
  first request) is reported with the workload.
* output tok/s and req/s over the makespan (first send to last completion); TTFT (first non-empty
  text chunk) p50 / p90 / p99; e2e p50 / p99.
* where requests went (the gateway does not say over HTTP): this process also opens a Watch stream
  (``kv_events``) to every pod, as the gateway's in-memory index does. A request's last full prompt
  block hash is unique to it (its random suffix), so the pod whose radix cache stores (or evicts) it
  is the pod that served it; a tenant's last full prefix block, stored on a pod, means that pod
  (re)computed the tenant's prefix. Reported: requests per pod, pods per tenant, prefix
  (re)computations (``prefix_prefills``; T is the minimum), prefix evictions, per-pod load over time.
* routing-decision latency (the gateway does not expose its decisions): after the traffic, with the
  cluster still up and idle, this process times ``router.choose(prompt, candidates)`` of a fresh
  router of the same class, in-process, for every request's prompt in arrival order (``--decision-
  passes`` passes, a fresh router each): ``time.perf_counter()`` around the call, which includes
  hashing the prompt's blocks, the index lookup, the recent-routes memory and the load guard.
  cache-aware: an ``InMemoryPrefixIndex`` holding the pods' real end-of-run KV blocks (fed by the
  Watch streams above, exactly what the gateway's index is fed). cache-aware+redis: a
  ``RedisPrefixIndex`` on the live Redis the pods published to (one real loopback round trip per
  decision). Candidates: one ``SchedulerHandle`` per pod with the pod's load as sampled at the
  request's arrival time during the run. Not measured: the gateway's event-loop queueing before
  ``choose``. The run's own decisions by reason (prefix, no-match, balance, ...) come from the
  gateway's ``radixserve_router_decisions_total`` before and after the traffic
  (``routing.live_decision_reasons``).
* where the cores went: CPU seconds of every process (gateway, each scheduler and its busiest
  thread, the engine's; detokenizer; redis-server; this client) from the first request to the last
  response (``cpu_s``, from /proc). On 2 cores the engines' threads take about 90% of it.

The Watch streams above add one KV-event subscriber per pod in every configuration alike. Before any
traffic, the run checks that the launcher gave every service its own port and that every process is
alive (``launcher.free_port`` can draw one port twice; a scheduler that then fails to bind still
passes the launcher's health check through the other one at that address), and again afterwards.

Ratios vs round-robin at each rate: hit rate x, output throughput x, TTFT p90 divided (round-robin
/ config). The highest rate is run ``--saturation-repeats`` times in all (3; round-robin and the
cache-aware configs, order alternating; least-load once): one run there moves by 5-15% on the 2-core VM,
so its throughput ratio is paired within each repeat and judged on the median of the repeats
(``repeats``, ``output_tok_s_x_each`` in the JSON).
Targets (measured, never asserted; PASS/FAIL per cache-aware config and rate, and the rates where
each passed): hit rate >= 3.8x round-robin's, throughput >= 1.9x (meaningful at the highest rate
only), TTFT p90 >= 10x lower, decision p99 < 2 ms.

    .venv/bin/python benchmarks/routing.py [--quick] [--out DIR] [--rates R ...] [--num-requests N] ...
    radixserve bench routing [same flags]

Writes DIR/routing.json and DIR/routing.png.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_*.py
import _common as common
from _common import SPECIAL_IDS
from _machine import machine_info

BLOCK_SIZE = 16  # the gateway's and schedulers' default --block-size
BASELINE = "round-robin"
CONFIGS = ("cache-aware", "least-load", "round-robin", "cache-aware+redis")
POLICY = {"cache-aware": "cache-aware", "least-load": "least-load", "round-robin": "round-robin"}
POLICY["cache-aware+redis"] = "cache-aware"
TARGET_HIT_RATIO = 3.8
TARGET_THROUGHPUT_RATIO = 1.9
TARGET_TTFT_P90_DIVISOR = 10.0
TARGET_DECISION_P99_MS = 2.0

FULL, QUICK = common.presets(
    (  # (setting, full run, --quick)
        ("model_size", "small", "tiny"),
        ("schedulers", 4, 2),
        ("num_requests", 240, 32),
        ("rates", (1.0, 4.0, 6.0, math.inf), (16.0,)),
        ("tenants", 16, 4),
        ("prefix_range", (500, 1000), (96, 160)),
        ("suffix_range", (20, 60), (17, 24)),
        ("output_range", (8, 32), (4, 8)),
        ("kv_prefixes", 5.0, 3.0),
        ("page_size", 16, 16),
        ("max_running_requests", 32, 16),
        ("decision_passes", 3, 2),
        ("saturation_repeats", 3, 1),
    )
)


# --------------------------------------------------------------------------- workload
def build_workload(
    num_requests: int,
    rate: float,
    tenants: int,
    prefix_range: tuple[int, int],
    suffix_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> dict:
    """Seeded: ``prefixes`` (one token-id list per tenant) and ``requests`` sorted by arrival, each
    ``arrival`` (s), ``tenant``, ``prefix_len``, ``input_ids`` (prefix + unique suffix), ``output_len``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prefixes = [
        common.random_token_ids(rng, vocab_size, common.draw_len(rng, prefix_range)) for _ in range(tenants)
    ]
    reqs = []
    for t in common.poisson_arrivals(rng, num_requests, rate):
        k = int(rng.integers(tenants))
        suffix = common.random_token_ids(rng, vocab_size, common.draw_len(rng, suffix_range))
        reqs.append(
            {
                "arrival": float(t),
                "tenant": k,
                "prefix_len": len(prefixes[k]),
                "input_ids": prefixes[k] + suffix,
                "output_len": common.draw_len(rng, output_range),
            }
        )
    return {"prefixes": prefixes, "requests": reqs}


def at_rate(wl: dict, base_rate: float, rate: float) -> dict:
    """The same requests arriving at ``rate`` instead of ``base_rate`` (gaps scaled; ``inf``: all at
    t=0), so every rate of a sweep sends the same prompts in the same order."""
    scale = base_rate / rate if math.isfinite(rate) else 0.0
    return {**wl, "requests": [{**r, "arrival": r["arrival"] * scale} for r in wl["requests"]]}


def rate_label(rate: float) -> str:
    return f"{rate:g}" if math.isfinite(rate) else "inf"


def ideal_hit_rate(reqs: list[dict], page_size: int) -> float:
    """Every tenant on one pod that never evicts it: each request after the tenant's first hits its
    page-aligned prefix (the scheduler caches whole pages)."""
    seen: set[int] = set()
    hit = 0
    for r in reqs:
        if r["tenant"] in seen:
            hit += r["prefix_len"] // page_size * page_size
        seen.add(r["tenant"])
    return hit / max(1, sum(len(r["input_ids"]) for r in reqs))


def workload_summary(wl: dict, page_size: int) -> dict:
    reqs = wl["requests"]
    plens = [len(p) for p in wl["prefixes"]]
    per_tenant = [sum(r["tenant"] == k for r in reqs) for k in range(len(plens))]
    return {
        "num_requests": len(reqs),
        "tenants": len(plens),
        "prefix_lens": plens,
        "requests_per_tenant": per_tenant,
        **common.length_totals(reqs),
        "last_arrival_s": reqs[-1]["arrival"],
        "ideal_hit_rate": ideal_hit_rate(reqs, page_size),
    }


def kv_tokens(prefix_lens: Sequence[int], kv_prefixes: float, page_size: int) -> int:
    """Room for ``kv_prefixes`` mean-length prefixes, rounded up to whole pages."""
    mean = sum(prefix_lens) / len(prefix_lens)
    return math.ceil(kv_prefixes * mean / page_size) * page_size


# ---------------------------------------------------------------------- attribution
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
                    self.index.apply(address, stored, removed, u.cleared)
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
            k, p = r["tenant"], self.pod_of_request.get(i)
            if k in seen and cached is not None and cached[i] == 0:
                re_misses += 1
            seen.add(k)
            if p is None:
                continue
            first_pod.setdefault(k, p)
            if k in last_pod and last_pod[k] != p:
                moves += 1
            last_pod[k] = p
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


# ------------------------------------------------------------------------------ client
def _routed_record(req: dict, stream: common.Stream, start: float) -> dict:
    """A request's record from its stream (times from the moment it was sent), with the prompt
    tokens its pod found cached."""
    rec = common.new_record(
        req,
        tenant=req.get("tenant"),
        cached_tokens=0,
        finish_reason=stream.finish_reason,
        error=stream.error,
    )
    rec["arrival"] = stream.sent - start  # the actual send time (the schedule up to event-loop lag)
    usage = stream.usage
    if usage:
        rec["output_tokens"] = int(usage["completion_tokens"])
        rec["prompt_tokens"] = int(usage["prompt_tokens"])
        rec["cached_tokens"] = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if not stream.times or rec["error"]:
        rec["error"] = rec["error"] or "no text chunk"
        return rec
    rec["ttft"] = stream.times[0] - stream.sent
    rec["e2e"] = stream.end - stream.sent
    common.judge_record(rec)
    return rec


async def _stream_one(client: Any, url: str, req: dict, start: float) -> dict:
    return _routed_record(req, await common.stream_completion(client, url, req, start), start)


async def _run_requests(url: str, reqs: list[dict], start: float) -> list[dict]:
    async with common.http_client(len(reqs), read_timeout_s=900.0) as client:
        tasks = [asyncio.create_task(_stream_one(client, url, r, start)) for r in reqs]
        return list(await asyncio.gather(*tasks))


async def _warm(url: str, n: int, vocab_size: int) -> None:
    """``n`` short requests one after another, prompts unrelated to the tenants: every pod runs a
    forward before the clock starts (round-robin and the least-loaded rotation both visit each)."""
    import httpx

    async with httpx.AsyncClient(timeout=120.0) as client:
        for i in range(n):
            ids = [SPECIAL_IDS + (97 * i + 13 * j + 1) % (vocab_size - SPECIAL_IDS) for j in range(24)]
            rec = await _stream_one(client, url, {"arrival": 0.0, "input_ids": ids, "output_len": 2}, 0.0)
            if not rec["ok"]:
                raise RuntimeError(f"warm-up request failed: {rec['error']}")


# ------------------------------------------------------------------------------- stats
def summarize(records: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    out_tokens = sum(r["output_tokens"] for r in ok)
    first = min((r["arrival"] for r in records), default=0.0)
    makespan = max((r["e2e"] + r["arrival"] for r in ok), default=float("nan")) - first
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else float("nan"),
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "output_tok_s": out_tokens / makespan,
        "request_s": len(ok) / makespan,
        **common.ms_percentiles("ttft", ttft, (50, 90, 99)),
        **common.ms_percentiles("e2e", e2e),
        "all_exact": common.all_exact(records),
    }


def _public(rec: dict) -> dict:
    keep = (
        "arrival",
        "tenant",
        "pod",
        "prompt_tokens",
        "cached_tokens",
        "output_tokens",
        "ok",
        "ttft",
        "e2e",
    )
    out = {k: rec.get(k) for k in keep}
    if rec.get("error"):
        out["error"] = rec["error"]
    return out


# ---------------------------------------------------------------------- decision latency
def time_decisions(
    policy: str,
    index: Any,
    addresses: Sequence[str],
    monitor: PodMonitor,
    reqs: list[dict],
    passes: int,
) -> dict:
    """``choose`` of a fresh router per pass, timed per call (see the module doc)."""
    import gc

    from radixserve.common.rpc import pb
    from radixserve.tokenizer.router import (
        CacheAwareRouter,
        LeastLoadRouter,
        RoundRobinRouter,
    )
    from radixserve.tokenizer.scheduler_pool import SchedulerHandle

    handles = [SchedulerHandle(a, healthy=True) for a in addresses]
    loads = [[monitor.load_at(a, r["arrival"]) or pb.Load(address=a) for a in addresses] for r in reqs]
    times: list[float] = []
    inner: list[float] = []
    reasons: dict[str, int] = {}
    if index is not None and reqs:  # a warm connection (and loaded script), as a serving gateway has
        from radixserve.common.block_hash import block_hashes

        index.match(block_hashes(reqs[0]["input_ids"], common.MODEL_NAME, BLOCK_SIZE))
    gc.collect()
    for _ in range(passes):
        if policy == "cache-aware":
            router: Any = CacheAwareRouter(index, common.MODEL_NAME, BLOCK_SIZE)
        elif policy == "least-load":
            router = LeastLoadRouter()
        else:
            router = RoundRobinRouter()
        for r, ld in zip(reqs, loads, strict=True):
            for h, lo in zip(handles, ld, strict=True):
                h.load = lo
            ids = r["input_ids"]
            t = time.perf_counter()
            router.choose(ids, handles)
            times.append(time.perf_counter() - t)
        for d in router.decisions:
            inner.append(d.seconds)
            reasons[d.reason] = reasons.get(d.reason, 0) + 1
    ms = 1e3
    return {
        "decisions": len(times),
        **common.ms_percentiles("decision", times),
        "decision_ms_max": ms * max(times),
        "decision_ms_mean": ms * sum(times) / len(times),
        **common.ms_percentiles("router_recorded", inner, (99,)),
        "replay_reasons": reasons,
        "index": type(index).__name__ if index is not None else None,
    }


# --------------------------------------------------------------------------------- redis
class RedisServer:
    """A foreground ``redis-server`` child on a free port, nothing persisted; stopped by its pid."""

    def __init__(self, binary: str) -> None:
        from radixserve.launcher import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        import redis

        r = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 15
        while True:
            try:
                if r.ping():
                    break
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not come up")
            time.sleep(0.05)
        r.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------------- runs
def gateway_decisions(url: str) -> dict[str, float]:
    """The gateway's own count of its routing decisions by reason (its /metrics)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("radixserve_router_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


def _ports(cluster: Any) -> list[str]:
    """Every port the cluster's command lines name (--port, --grpc-port, --metrics-port, ...)."""
    out = []
    for svc in cluster.services:
        for flag, value in zip(svc.argv, svc.argv[1:], strict=False):
            if flag.startswith("--") and flag.endswith("port"):
                out.append(value)
    return out


def _check_alive(cluster: Any, when: str) -> None:
    """Every process still runs and every scheduler has its own address (a scheduler that could not
    bind its port would otherwise pass the launcher's health check through another one's)."""
    dead = [s.name for s in cluster.services if not s.alive()]
    addresses = [s.grpc_address for s in cluster.schedulers]
    if dead or len(set(addresses)) != len(addresses):
        raise RuntimeError(f"cluster broken {when}: exited {dead}, scheduler addresses {addresses}")


def _cpu_seconds(stat_path: str) -> float:
    """User + system CPU time of a process or thread (``/proc/PID/stat``, ``/proc/PID/task/TID/stat``)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except FileNotFoundError:  # a thread that ended
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def _teardown(cluster: Any, redis_srv: RedisServer | None) -> None:
    try:
        cluster.stop(drain_timeout=5)
    finally:
        if redis_srv is not None:
            redis_srv.stop()


def run_config(
    name: str,
    model: Path,
    wl: dict,
    eargs: dict,
    args: argparse.Namespace,
    previous: threading.Thread | None = None,
    label: str = "",
    time_routing: bool = True,
) -> tuple[dict, threading.Thread]:
    """One configuration on a fresh cluster. Returns its results and the thread stopping its cluster
    (and Redis): the next configuration starts its own meanwhile and waits for that thread before
    sending any traffic (``previous``), so no two clusters are ever up during a measurement.
    ``time_routing``: replay the decisions for their latency (off for the saturation repeats)."""
    from radixserve.common.prefix_index import RedisPrefixIndex
    from radixserve.launcher import build_cluster, free_port

    policy = POLICY[name]
    t_cfg = time.perf_counter()
    redis_srv = RedisServer(args.redis_server) if name.endswith("+redis") else None

    def fresh_cluster() -> Any:
        for _ in range(20):  # launcher.free_port can hand out one port twice: draw again
            c = build_cluster(
                model,
                common.MODEL_NAME,
                port=free_port(),
                schedulers=args.schedulers,
                scheduler_args=common.scheduler_flags(eargs),
                gateway_args=["--router", policy],
                torch_threads=args.threads,
                drain_timeout=5.0,
                prefix_index=redis_srv.url if redis_srv else "memory",
            )
            ports = _ports(c)
            if len(set(ports)) == len(ports):
                break
            print(f"  {name}: the launcher drew a port twice ({sorted(ports)}); drawing again", flush=True)
        return c

    cluster = fresh_cluster()
    stopper = threading.Thread(target=lambda: _teardown(cluster, redis_srv), name=f"stop-{name}")
    try:
        for attempt in range(3):  # a port taken by someone else between the draw and the bind
            try:
                cluster.start(timeout=300)
                _check_alive(cluster, "after start")
                break
            except RuntimeError as e:
                cluster.stop(drain_timeout=1)
                if attempt == 2:
                    raise
                print(f"  {name}: {e}; starting a fresh cluster", flush=True)
                cluster = fresh_cluster()
        started_s = time.perf_counter() - t_cfg
        if previous is not None:
            previous.join()
        addresses = [s.grpc_address or "" for s in cluster.schedulers]
        attribution = Attribution(wl, BLOCK_SIZE)
        times: dict[str, float] = {}
        cpu = CpuMeter(cluster, redis_srv)
        cpu_used: dict[str, float] = {}
        live_reasons: dict[str, int] = {}  # the gateway's decisions during the traffic, by reason

        async def traffic() -> tuple[list[dict], PodMonitor]:
            t = time.perf_counter()
            await _warm(cluster.url, 2 * args.schedulers, args.vocab_size)
            times["warm_s"] = time.perf_counter() - t
            monitor = PodMonitor(addresses, attribution)
            start = time.perf_counter() + 0.3  # the Watch snapshots arrive; every task is sleeping
            monitor.start(start)
            cpu_before = cpu.read()
            decisions_before = await asyncio.to_thread(gateway_decisions, cluster.url)
            records = await _run_requests(cluster.url, wl["requests"], start)
            cpu_used.update(CpuMeter.used(cpu_before, cpu.read()))
            after = await asyncio.to_thread(gateway_decisions, cluster.url)
            live_reasons.update({k: int(v - decisions_before.get(k, 0)) for k, v in after.items()})
            times["cpu_window_s"] = time.perf_counter() - start
            await asyncio.sleep(0.5)  # the last block events
            monitor.stop()
            times["traffic_wall_s"] = time.perf_counter() - start
            return records, monitor

        with common.Meter() as traffic_meter:
            records, monitor = asyncio.run(traffic())
        _check_alive(cluster, "after the traffic")
        for i, rec in enumerate(records):
            rec["pod"] = monitor.pod_of_request.get(i)
        summary = summarize(records)
        routing = monitor.summary(wl, summary["makespan_s"], [r["cached_tokens"] for r in records])
        routing["unattributable_requests"] = attribution.unattributable
        routing["live_decision_reasons"] = live_reasons
        t = time.perf_counter()
        index: Any = None
        decision: dict[str, Any] = {}
        if policy == "cache-aware" and time_routing:
            # +redis: the pods' live published state; memory: what the gateway's index was fed
            index = RedisPrefixIndex(redis_srv.url) if redis_srv is not None else monitor.index
        try:
            if time_routing:
                decision = time_decisions(
                    policy, index, addresses, monitor, wl["requests"], args.decision_passes
                )
        finally:
            if isinstance(index, RedisPrefixIndex):
                index.redis.close()
        times["decision_replay_s"] = time.perf_counter() - t
    finally:
        stopper.start()
    s = summary
    print(
        f"  {label}{name}: {s['completed']}/{len(records)} ok, hit rate {s['hit_rate']:.3f},"
        f" {s['output_tok_s']:.1f} out tok/s, TTFT p90 {s['ttft_ms_p90']:.0f} ms,"
        + (f" decision p99 {decision['decision_ms_p99']:.3f} ms," if decision else "")
        + f" requests per pod {routing['requests_per_pod']}, prefix prefills {routing['prefix_prefills']},"
        f" decisions {live_reasons}"
        f" ({time.perf_counter() - t_cfg:.0f} s); CPU s over {times['cpu_window_s']:.1f} s: {cpu_used}",
        flush=True,
    )
    result = {
        "policy": policy,
        "prefix_index": "redis" if redis_srv else "memory",
        "scheduler_addresses": addresses,
        "summary": summary,
        "routing": routing,
        "decision": decision,
        "cluster_start_s": started_s,
        **times,
        "loadavg_1m_before_after": traffic_meter.loadavg_before_after(),
        # CPU seconds per process from just before the first request to the last response
        # (cpu_window_s; the client's count includes its monitor's polling)
        "cpu_s": cpu_used,
        "requests": [_public(r) for r in records],
    }
    return result, stopper


def compare(results: dict) -> dict:
    base = results[BASELINE]["summary"]
    per: dict[str, Any] = {}
    for name, res in results.items():
        s = res["summary"]
        per[name] = {
            "hit_rate_x": s["hit_rate"] / base["hit_rate"] if base["hit_rate"] > 0 else float("inf"),
            "output_tok_s_x": s["output_tok_s"] / base["output_tok_s"],
            "request_s_x": s["request_s"] / base["request_s"],
            "ttft_p90_divisor": base["ttft_ms_p90"] / s["ttft_ms_p90"],
        }
    verdict: dict[str, Any] = {"vs_round_robin": per, "targets": {}}
    for name in results:
        if POLICY[name] != "cache-aware":
            continue
        v, d = per[name], results[name]["decision"]
        verdict["targets"][name] = {
            f"hit_rate_ge_{TARGET_HIT_RATIO:g}x": v["hit_rate_x"] >= TARGET_HIT_RATIO,
            f"throughput_ge_{TARGET_THROUGHPUT_RATIO:g}x": v["output_tok_s_x"] >= TARGET_THROUGHPUT_RATIO,
            f"ttft_p90_ge_{TARGET_TTFT_P90_DIVISOR:g}x_lower": v["ttft_p90_divisor"]
            >= TARGET_TTFT_P90_DIVISOR,
            f"decision_p99_lt_{TARGET_DECISION_P99_MS:g}ms": d["decision_ms_p99"] < TARGET_DECISION_P99_MS,
        }
    verdict["every_request_exact"] = all(r["summary"]["all_exact"] for r in results.values())
    return verdict


def saturation_lite(res: dict) -> dict:
    """What a repeat at the highest rate keeps: throughput and where the requests went."""
    s, r = res["summary"], res["routing"]
    return {
        "output_tok_s": s["output_tok_s"],
        "hit_rate": s["hit_rate"],
        "makespan_s": s["makespan_s"],
        "all_exact": s["all_exact"],
        "requests_per_pod": r["requests_per_pod"],
        "prefix_prefills": r["prefix_prefills"],
        "cpu_s": res["cpu_s"],
    }


def judge_saturation(top: dict, repeats: list[dict[str, dict]]) -> None:
    """The highest rate's throughput ratio, paired within each repeat (the first is ``top`` itself),
    judged on the median: one run there moves by ~5% on the 2-core VM. Updates ``top`` in place."""
    top["repeats"] = repeats
    for name, targets in top["verdict"]["targets"].items():
        each = [r[name]["output_tok_s"] / r[BASELINE]["output_tok_s"] for r in repeats]
        v = top["verdict"]["vs_round_robin"][name]
        v["output_tok_s_x_each"] = each
        v["output_tok_s_x_median"] = statistics.median(each)
        targets[f"throughput_ge_{TARGET_THROUGHPUT_RATIO:g}x"] = (
            v["output_tok_s_x_median"] >= TARGET_THROUGHPUT_RATIO
        )
    top["verdict"]["every_request_exact"] &= all(x["all_exact"] for r in repeats for x in r.values())


def overall(runs: list[dict]) -> dict:
    """Per cache-aware configuration and target, the rates where it was met. Throughput is only a
    ratio of capacities at the highest rate: below saturation every router serves what is offered."""
    top = runs[-1]  # the rates run in increasing order
    out: dict[str, Any] = {}
    for name, targets in top["verdict"]["targets"].items():
        out[name] = {
            "met_at_rates": {
                k: [r["rate"] for r in runs if r["verdict"]["targets"][name][k]] for k in targets
            },
            "highest_rate": top["rate"],
            "throughput_x_at_highest_rate": top["verdict"]["vs_round_robin"][name].get(
                "output_tok_s_x_median", top["verdict"]["vs_round_robin"][name]["output_tok_s_x"]
            ),
            "throughput_x_at_highest_rate_each": top["verdict"]["vs_round_robin"][name].get(
                "output_tok_s_x_each", [top["verdict"]["vs_round_robin"][name]["output_tok_s_x"]]
            ),
        }
    return out


def format_table(results: dict, verdict: dict) -> str:
    head = (
        f"{'config':18} {'ok':>9} {'hit':>6} {'hit x':>6} {'out tok/s':>9} {'req/s':>6} {'thr x':>6}"
        f" {'TTFT50':>7} {'TTFT90':>7} {'TTFT99':>7} {'/p90':>6} {'e2e50':>7} {'dec50':>6} {'dec99':>6}"
        f" {'per pod':>17} {'prefills':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, res in results.items():
        s, d, r = res["summary"], res["decision"], res["routing"]
        v = verdict["vs_round_robin"][name]
        pods = "/".join(map(str, r["requests_per_pod"]))
        lines.append(
            f"{name:18} {s['completed']:>4}/{s['completed'] + s['failed']:<4} {s['hit_rate']:>6.3f}"
            f" {v['hit_rate_x']:>5.2f}x {s['output_tok_s']:>9.1f} {s['request_s']:>6.2f}"
            f" {v['output_tok_s_x']:>5.2f}x"
            f" {s['ttft_ms_p50']:>7.0f} {s['ttft_ms_p90']:>7.0f} {s['ttft_ms_p99']:>7.0f}"
            f" {v['ttft_p90_divisor']:>5.1f}x {s['e2e_ms_p50']:>7.0f}"
            f" {d['decision_ms_p50']:>6.3f} {d['decision_ms_p99']:>6.3f} {pods:>17} {r['prefix_prefills']:>8}"
        )
    lines.append(
        "(times in ms; hit = cached / prompt tokens; x and /p90 vs round-robin; dec = routing decision,"
        " in-process replay; per pod = requests served by each pod; prefills = tenant prefixes"
        " (re)computed on some pod)"
    )
    for name, t in verdict["targets"].items():
        v, d = verdict["vs_round_robin"][name], results[name]["decision"]
        got = {
            f"hit_rate_ge_{TARGET_HIT_RATIO:g}x": f"{v['hit_rate_x']:.2f}x",
            f"throughput_ge_{TARGET_THROUGHPUT_RATIO:g}x": (
                f"{v['output_tok_s_x_median']:.2f}x (median of the paired repeats)"
                if "output_tok_s_x_median" in v
                else f"{v['output_tok_s_x']:.2f}x"
            ),
            f"ttft_p90_ge_{TARGET_TTFT_P90_DIVISOR:g}x_lower": f"{v['ttft_p90_divisor']:.1f}x",
            f"decision_p99_lt_{TARGET_DECISION_P99_MS:g}ms": f"{d['decision_ms_p99']:.3f} ms",
        }
        for key, ok in t.items():
            lines.append(f"target {name}: {key}: {got[key]} -> {'PASS' if ok else 'FAIL'}")
    lines.append(
        f"every request exact (finish 'length', right token count): {verdict['every_request_exact']}"
    )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path, ideal: float | None = None) -> None:
    """One panel per measure, offered rate on x, a line per configuration."""
    plt = common.pyplot()
    colors = {"cache-aware": "#4c72b0", "least-load": "#dd8452", "round-robin": "#8c8c8c"}
    colors["cache-aware+redis"] = "#55a868"
    labels = [r["rate"] for r in runs]
    x = list(range(len(runs)))
    names = list(runs[0]["results"])
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.6))
    panels = (
        (lambda res: res["summary"]["hit_rate"], "cache hit rate (cached / prompt tokens)", "fraction"),
        (lambda res: res["summary"]["output_tok_s"], "output throughput", "output tokens / s"),
        (lambda res: res["summary"]["ttft_ms_p90"], "TTFT p90", "ms (log)"),
        (
            lambda res: res["decision"]["decision_ms_p99"],
            "routing decision p99 (in-process replay)",
            "ms (log)",
        ),
    )
    for ax, (get, title, ylab) in zip(axes, panels, strict=True):
        for n in names:
            ys = [get(r["results"][n]) for r in runs]
            ax.plot(x, ys, "o-", color=colors.get(n, "#999999"), label=n)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylab)
        ax.set_xticks(x, labels)
        ax.set_xlabel("offered load, req/s (inf: all at t=0)")
    if ideal is not None:
        axes[0].axhline(ideal, color="k", ls=":", lw=1, label=f"ideal (one pod per tenant) {ideal:.2f}")
    axes[0].set_ylim(0, 1)
    axes[2].set_yscale("log")
    axes[3].set_yscale("log")
    axes[3].axhline(
        TARGET_DECISION_P99_MS, color="k", ls=":", lw=1, label=f"target < {TARGET_DECISION_P99_MS:g} ms"
    )
    for ax in (axes[0], axes[3]):
        ax.legend(fontsize=7)
    # ratios vs round-robin under the throughput and TTFT panels' titles
    for ax, key, fmt in ((axes[1], "output_tok_s_x", "{:.2f}x"), (axes[2], "ttft_p90_divisor", "/{:.1f}")):
        for n in names:
            if POLICY[n] != "cache-aware":
                continue
            for i, r in enumerate(runs):
                y = (
                    r["results"][n]["summary"]["output_tok_s"]
                    if key == "output_tok_s_x"
                    else r["results"][n]["summary"]["ttft_ms_p90"]
                )
                ax.annotate(
                    fmt.format(r["verdict"]["vs_round_robin"][n][key]),
                    (i, y),
                    fontsize=7,
                    xytext=(4, 4),
                    textcoords="offset points",
                    color=colors.get(n, "#999999"),
                )
    common.save_figure(fig, path)


# --------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_arg(p)
    p.add_argument("--schedulers", type=int, default=None, help=f"scheduler pods ({FULL['schedulers']})")
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="Poisson arrival rates to sweep, req/s; inf: all at t=0"
        f" ({' '.join(map(rate_label, FULL['rates']))})",
    )
    p.add_argument("--num-requests", type=int, default=None, help=f"({FULL['num_requests']})")
    p.add_argument("--tenants", type=int, default=None, help=f"distinct system prompts ({FULL['tenants']})")
    p.add_argument("--prefix-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--suffix-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument(
        "--kv-prefixes",
        type=float,
        default=None,
        help=f"per-pod KV capacity in mean-length tenant prefixes ({FULL['kv_prefixes']})",
    )
    p.add_argument(
        "--max-total-tokens", type=int, default=None, help="per-pod KV tokens (overrides --kv-prefixes)"
    )
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads per scheduler (1)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="another scheduler engine argument, e.g. chunked_prefill_size=512 (repeatable)",
    )
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=None, help="subset to run (all)")
    p.add_argument("--redis-server", default=None, help="redis-server binary (default: from PATH)")
    p.add_argument("--decision-passes", type=int, default=None, help="replays of the decisions per config")
    p.add_argument(
        "--saturation-repeats",
        type=int,
        default=None,
        help="runs of the highest rate (round-robin and cache-aware configs), each a paired throughput"
        f" ratio, judged on the median ({FULL['saturation_repeats']})",
    )
    common.add_run_args(p, quick_help="tiny model, 2 pods, few requests (< 90 s)")
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, QUICK)
    if args.num_requests < 1 or args.schedulers < 1 or args.tenants < 1 or not all(r > 0 for r in args.rates):
        p.error("--num-requests, --schedulers, --tenants and --rates must be positive")
    args.rates = sorted(set(args.rates))
    if any("=" not in kv for kv in args.engine_arg):
        p.error("--engine-arg takes NAME=VALUE")
    common.check_ranges(p, args, ("prefix_range", "suffix_range", "output_range"))
    args.configs = list(args.configs or CONFIGS)
    if BASELINE not in args.configs:
        args.configs.append(BASELINE)
    args.redis_server = args.redis_server or shutil.which("redis-server")
    args.skipped = {}
    if "cache-aware+redis" in args.configs and not args.redis_server:
        args.configs.remove("cache-aware+redis")
        args.skipped["cache-aware+redis"] = "no redis-server binary"
    args.configs = [c for c in CONFIGS if c in args.configs]  # a fixed order
    return args


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    machine = machine_info()
    with common.model_folder(args) as model_path:
        args.vocab_size = common.model_vocab_size(model_path)
        wl = build_workload(  # at 1 req/s; each rate of the sweep scales the gaps
            args.num_requests,
            1.0,
            args.tenants,
            tuple(args.prefix_range),
            tuple(args.suffix_range),
            tuple(args.output_range),
            args.vocab_size,
            args.seed,
        )
        plens = [len(x) for x in wl["prefixes"]]
        total = args.max_total_tokens or kv_tokens(plens, args.kv_prefixes, args.page_size)
        eargs = dict(
            page_size=args.page_size,
            max_total_tokens=total,
            max_running_requests=args.max_running_requests,
        )
        for kv in args.engine_arg:
            name, _, value = kv.partition("=")
            eargs[name] = value
        summary = workload_summary(wl, args.page_size)
        config = {
            "model": common.model_description(args),
            "quick": args.quick,
            "seed": args.seed,
            "schedulers": args.schedulers,
            "torch_threads_per_scheduler": args.threads,
            "configs": args.configs,
            "skipped": args.skipped,
            "rates": [rate_label(r) for r in args.rates],
            "num_requests": args.num_requests,
            "tenants": args.tenants,
            "prefix_range": list(args.prefix_range),
            "suffix_range": list(args.suffix_range),
            "output_range": list(args.output_range),
            "kv_prefixes": None if args.max_total_tokens else args.kv_prefixes,
            "engine_args": eargs,
            "scheduler_flags": common.scheduler_flags(eargs),
            "gateway_defaults": "--block-size 16 --balance-abs-threshold 16 --balance-rel-threshold 1.5"
            " --recent-ttl 10",
            "sampling": "greedy (temperature 0), ignore_eos, max_tokens = output length",
            "prompts": "tenant prefix (random token ids) + unique random suffix, sent as token ids",
            "arrivals": "Poisson (exponential gaps, first at t=0), the same draw scaled to each rate",
            "decision_latency": "in-process replay of router.choose per request prompt with the pods'"
            " sampled loads; cache-aware: InMemoryPrefixIndex fed the pods' real KV block events;"
            " +redis: RedisPrefixIndex on the live Redis the pods published to",
            "workload": summary,
        }
        print(
            f"{args.schedulers} pods, {args.tenants} tenants, {args.num_requests} requests"
            f" at {' '.join(map(rate_label, args.rates))} req/s"
            f" (last arrival {summary['last_arrival_s'] / args.rates[0]:.1f} s at the lowest),"
            f" engine args {eargs}, configs {args.configs}",
            flush=True,
        )
        runs = []
        stopper: threading.Thread | None = None
        try:
            for rate in args.rates:
                label = rate_label(rate)
                wl_r = at_rate(wl, 1.0, rate)
                results = {}
                for name in args.configs:
                    results[name], stopper = run_config(
                        name, model_path, wl_r, eargs, args, stopper, label=f"{label} req/s "
                    )
                runs.append({"rate": label, "results": results, "verdict": compare(results)})
            # The highest rate again (baseline and cache-aware configs), alternating the order, for
            # a throughput ratio paired within each repeat.
            top, rate = runs[-1], args.rates[-1]
            names = [n for n in args.configs if n == BASELINE or POLICY[n] == "cache-aware"]
            repeats = [{n: saturation_lite(top["results"][n]) for n in names}]
            if BASELINE in names:
                for k in range(1, args.saturation_repeats):
                    again = {}
                    for name in names[::-1] if k % 2 else names:
                        res, stopper = run_config(
                            name,
                            model_path,
                            at_rate(wl, 1.0, rate),
                            eargs,
                            args,
                            stopper,
                            label=f"{top['rate']} req/s repeat {k}: ",
                            time_routing=False,
                        )
                        again[name] = saturation_lite(res)
                    repeats.append(again)
                judge_saturation(top, repeats)
        finally:
            if stopper is not None:
                stopper.join()
        report: dict[str, Any] = {
            "benchmark": "routing: cache-aware vs least-load vs round-robin across scheduler pods",
            "config": config,
            "machine": machine,
            "runs": runs,
            "targets": overall(runs),
        }
        return common.finish_report(report, t_start)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    ideal = report["config"]["workload"]["ideal_hit_rate"]
    json_path, png_path = common.write_outputs(
        args.out, "routing", report, lambda path: plot(report["runs"], path, ideal)
    )
    for r in report["runs"]:
        print(f"\noffered load {r['rate']} req/s")
        print(format_table(r["results"], r["verdict"]))
    print()
    for name, t in report["targets"].items():
        for key, rates in t["met_at_rates"].items():
            print(f"{name}: {key}: met at rates {rates or 'none'}")
        x, each = t["throughput_x_at_highest_rate"], t["throughput_x_at_highest_rate_each"]
        print(
            f"{name}: throughput x at the highest rate ({t['highest_rate']}): {x:.2f}x"
            f" (median of {len(each)} paired repeats: {', '.join(f'{e:.2f}' for e in each)})"
        )
    print(f"wall {report['benchmark_wall_s']:.0f} s; wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
