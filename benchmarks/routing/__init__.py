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

    .venv/bin/python benchmarks/routing [--quick] [--out DIR] [--rates R ...] [--num-requests N] ...
    radixserve bench routing [same flags]

Writes DIR/routing.json and DIR/routing.png.
"""


# The modules, one job each: settings (configurations, targets, presets), cli (flags), workload
# (tenants and requests), cluster (a configuration's processes), client (the HTTP traffic), monitor
# (Watch streams: where requests went), cpu (CPU seconds per process), decisions (the routing-latency
# replay), runner (one configuration), sweep (every rate, the repeats, the report), analysis
# (summaries and verdicts), table (the console report), plot (the PNG).

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks share benchmarks/_*.py
import _common as common
from _common import SPECIAL_IDS, rate_label  # part of the package's names (the tests use some)

from .analysis import compare, judge_saturation, overall, public_record, saturation_lite, summarize
from .cli import parse_args
from .cluster import RedisServer, gateway_decisions
from .cpu import CpuMeter
from .decisions import time_decisions
from .monitor import Attribution, PodMonitor
from .plot import plot
from .runner import run_config
from .settings import (
    BASELINE,
    BLOCK_SIZE,
    CONFIGS,
    FULL,
    POLICY,
    QUICK,
    TARGET_DECISION_P99_MS,
    TARGET_HIT_RATIO,
    TARGET_THROUGHPUT_RATIO,
    TARGET_TTFT_P90_DIVISOR,
)
from .sweep import run
from .table import format_table, print_report
from .workload import at_rate, build_workload, ideal_hit_rate, kv_tokens, workload_summary

__all__ = [
    "BASELINE",
    "BLOCK_SIZE",
    "CONFIGS",
    "FULL",
    "POLICY",
    "QUICK",
    "SPECIAL_IDS",
    "TARGET_DECISION_P99_MS",
    "TARGET_HIT_RATIO",
    "TARGET_THROUGHPUT_RATIO",
    "TARGET_TTFT_P90_DIVISOR",
    "Attribution",
    "CpuMeter",
    "PodMonitor",
    "RedisServer",
    "at_rate",
    "build_workload",
    "compare",
    "format_table",
    "gateway_decisions",
    "ideal_hit_rate",
    "judge_saturation",
    "kv_tokens",
    "main",
    "overall",
    "parse_args",
    "plot",
    "public_record",
    "rate_label",
    "run",
    "run_config",
    "saturation_lite",
    "summarize",
    "time_decisions",
    "workload_summary",
]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    ideal = report["config"]["workload"]["ideal_hit_rate"]
    json_path, png_path = common.write_outputs(
        args.out, "routing", report, lambda path: plot(report["runs"], path, ideal)
    )
    print_report(report)
    print(f"wall {report['benchmark_wall_s']:.0f} s; wrote {json_path} and {png_path}")
    return 0
