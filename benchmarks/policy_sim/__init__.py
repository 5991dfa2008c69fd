"""Schedule-policy simulation: the REAL BatchScheduler driven by a cost model, in virtual time.

What is real and what is not
----------------------------
Real: ``BatchScheduler`` with its ``RadixCache``, ``SchedulePolicy`` (fcfs / lpm / dfs-weight,
fairness, in-batch de-duplication), ``PrefillAdder`` (budgets, chunked prefill) and retraction.
NOT real: the forward pass. **No GPU and no model run here.** Each engine step takes a
virtual time given by the cost model below, and sampled tokens are seeded random ints
(requests end at ``max_new_tokens``, never at EOS). Times are virtual seconds, so the
results are machine independent and reproducible for a given seed.

Cost model (one engine step; constants in ``COST_MODEL``)::

    step_s = STEP_OVERHEAD_S                                  # launch / sampling / host work
           + PREFILL_PER_TOKEN_S * sum(extend_lens)           # computed prompt tokens only:
                                                              #   cache hits cost nothing here
           + DECODE_PER_REQ_S * batch_size   (decode steps)   # per-request decode cost
           + ATTN_PER_KV_TOKEN_S * sum(prefix_len + extend_len)  # KV read by attention

Workloads
---------
* ``burst32``: 32 requests at t=0 (arrival order seeded, times 1 us apart): 24 share one
  2,000-token system prompt followed by a unique 20-60-token question, 8 are unrelated
  (~2,000 unique tokens). Output 64-128 tokens. KV pool 9,000 tokens: about 4 requests'
  worth, so the order the scheduler picks decides what stays cached.
* ``poisson``: a seeded Poisson stream of 400 requests; a fraction ``p`` of them start with one
  of four shared system prompts (1,000 / 1,300 / 1,600 / 2,000 tokens, picked uniformly) plus a
  20-200-token unique question, the rest are unrelated 1,000-2,000-token prompts. Output 32-256
  tokens. KV pool 16,000 tokens. The rate is set per ``p`` (``POISSON_RATE``) so that fcfs
  runs loaded but stable: queues form (fcfs p50 wait 0.5-2 s) without growing for good.

Metrics (from the finished ``Req`` objects; each run asserts all requests finished and the
KV pool is back to full): hit_rate = sum(num_cached_tokens) / sum(prompt_len) at first
admission; its ceiling hit_rate_optimum = tokens seen before in the workload (shared
prefixes counted once, each request computing at least one token) / all prompt tokens;
for burst32 shared_prefix_hit_rate over the 24 x 2,000 shared tokens (optimum 23/24);
queue wait = admit_time - arrival_time (p50 / p99 / max); for fairness runs the largest
overdue delay max(0, wait - fairness_timeout), also in mean step times; throughput
(output tokens per virtual second), virtual makespan, steps, retractions.

Usage::

    python benchmarks/policy_sim [--quick] [--out DIR] [--seed N]
    radixserve bench policy_sim [same flags]

Library use (the tests load this package by path)::

    run(workload, policy, fairness_timeout=None, *, p=None, seed=0, quick=False, check_every=0) -> dict
"""

# The modules, one job each: cli (flags), cost_model (a step's virtual time), workloads (request specs
# and scheduler settings), simulation (the scheduler in virtual time, every setting), metrics (what a
# run measured), report (the JSON), table (the console report), plot (the PNG).

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts here share benchmarks/_*.py

from .cli import parse_args
from .plot import plot
from .report import document
from .simulation import run, run_sweep
from .table import print_table

# The command line, and what the tests use.
__all__ = ["main", "parse_args", "run"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    results = run_sweep(args.seed, args.quick)
    wall = time.perf_counter() - t0
    print_table(results)
    print(f"\n{len(results)} runs in {wall:.1f} s wall")

    args.out.mkdir(parents=True, exist_ok=True)
    doc = document(results, args.seed, args.quick)
    (args.out / "policy_sim.json").write_text(json.dumps(doc, indent=1) + "\n")
    if not args.no_plot:
        plot(results, args.out / "policy_sim.png")
    print(
        f"wrote {args.out / 'policy_sim.json'}"
        + ("" if args.no_plot else f" and {args.out / 'policy_sim.png'}")
    )
    return 0
