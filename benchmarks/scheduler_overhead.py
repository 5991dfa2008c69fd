"""Scheduler-overhead microbenchmark: CPU time of one scheduling step, no model.

What is timed (``time.process_time_ns`` per call; wall time with ``perf_counter_ns`` too):

* ``decode/schedule``: ``BatchScheduler.schedule()`` with N running requests and nothing
  waiting: retraction check, one KV slot per request, ``ScheduleBatch.decode``.
* ``decode/process``: ``BatchScheduler.process(batch, tokens)`` folding N sampled tokens back.
* ``decode/step``: the two together (one decode step's scheduler overhead).
* ``prefill/schedule``: ``schedule()`` with N waiting and N running: the policy orders the N
  waiting requests, the ``PrefillAdder`` admits until its budget stops it, the extend batch
  is built. Each repetition starts from the same state: the admissions are undone outside
  the timed region with ``KVCacheManager.release`` (what retraction does: frees the new
  pages, unlocks the matched prefix, frees the table row; nothing was written, so nothing
  is inserted in the tree), and the waiting queue is restored. The invariants are checked.

N is in {64, 256, 1024}, page_size in {1, 16}, policy in {lpm, fcfs}; ``lpm`` falls back to
fcfs above ``lpm_fcfs_threshold`` (128) waiting requests, so ``lpm-nothr`` (threshold above
N) is also measured for the prefill step, for information. Requests are in steady state:
long ``max_new_tokens`` (nothing finishes), KV large enough that nothing is retracted or
evicted, prompts of 200-1000+ tokens sharing system and document prefixes (radix tree of
about N + 60 nodes).

    .venv/bin/python benchmarks/scheduler_overhead.py [--quick] [--out DIR] [--profile]

Writes DIR/scheduler_overhead.json and DIR/scheduler_overhead.png. A smoke test can call
``main(["--quick", "--out", str(tmp_path)])`` or ``run_benchmark(...)``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode, ScheduleBatch
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.req import Req

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_machine.py
from _machine import machine_info

TIMER_NOTE = "time.process_time_ns per call (CPU time); wall_* columns: time.perf_counter_ns"
TARGET_US = 1000.0  # the target: under 1 ms per step at 256 running requests
TARGET_N = 256
VOCAB = 32000
MAX_PROMPT = 1100  # prompts are at most this long (prefixes + suffix)
PREFILL_MAX_NEW = 256  # max_new_tokens of requests in the prefill scenario (keeps the reserve modest)
DEFAULTS_RECORDED = ("max_prefill_tokens", "chunked_prefill_size", "lpm_fcfs_threshold", "dedup_min_tokens")
# The prefill budgets of the measured step (256 waiting: about 50 admitted, 16k tokens), as in the
# committed results: the benchmark's own setting, not the engine's default (8192, chunks by device).
PREFILL_BUDGET = {"max_prefill_tokens": 16384, "chunked_prefill_size": 8192}
DEFAULT_OUT = Path(__file__).resolve().parent / "results"

POLICY_CASES = {  # name -> (policy, lpm_fcfs_threshold or None for the default)
    "lpm": ("lpm", None),
    "fcfs": ("fcfs", None),
    "lpm-nothr": ("lpm", 1 << 30),
}


# --------------------------------------------------------------------------- workload
class Workload:
    """Prompts sharing prefixes: 8 system prompts, 48 documents under them, unique suffixes.

    One request in eight has no shared prefix. Total prompt length is drawn in [200, 1000],
    raised to the shared prefix + 16 unique tokens where the prefix is longer.
    """

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        rng = self.rng
        self.systems = [rng.integers(1, VOCAB, rng.integers(64, 257), dtype=np.int32) for _ in range(8)]
        self.docs = [
            np.concatenate([self.systems[i % 8], rng.integers(1, VOCAB, rng.integers(32, 257), np.int32)])
            for i in range(48)
        ]
        self.count = 0

    def prompt(self) -> np.ndarray:
        rng = self.rng
        target = int(rng.integers(200, 1001))
        shared = rng.random() >= 1 / 8
        prefix = self.docs[int(rng.integers(len(self.docs)))] if shared else np.zeros(0, np.int32)
        suffix = rng.integers(1, VOCAB, max(16, target - len(prefix)), dtype=np.int32)
        return np.concatenate([prefix, suffix])

    def requests(self, n: int, max_new_tokens: int) -> list[Req]:
        out = []
        for _ in range(n):
            self.count += 1
            out.append(
                Req(
                    rid=f"r{self.count}",
                    origin_ids=self.prompt(),
                    sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                    arrival_time=float(self.count),
                )
            )
        return out


class _Clock:
    def __init__(self) -> None:
        self.t = 1e6

    def __call__(self) -> float:
        return self.t


def build_scheduler(
    n: int, page_size: int, policy_case: str, max_new_tokens: int, waiting_too: bool, seed: int
) -> tuple[BatchScheduler, Workload]:
    """A scheduler with ``n`` running requests (all prefilled) and an empty waiting queue.

    Sized so nothing is evicted or retracted: room for ``2n`` requests when ``waiting_too``.
    """
    policy, thr = POLICY_CASES[policy_case]
    rows = 2 * n if waiting_too else n
    max_ctx = MAX_PROMPT + max_new_tokens + 64
    capacity = rows * (MAX_PROMPT + max_new_tokens + 2 * page_size) + 64 * page_size
    mem = MemoryConfig(
        max_total_tokens=capacity, page_size=page_size, max_running_requests=rows, max_context_len=max_ctx
    )
    kwargs = {} if thr is None else {"lpm_fcfs_threshold": thr}
    config = SchedulerConfig(memory=mem, policy=policy, **PREFILL_BUDGET, **kwargs)
    sched = BatchScheduler(config, eos_token_ids=(), clock=_Clock())
    wl = Workload(seed)
    for r in wl.requests(n, max_new_tokens):
        sched.add(r)
    rng = np.random.default_rng(seed + 1)
    while sched.waiting or sched.chunked is not None:
        b = sched.schedule()
        assert b is not None
        sched.process(b, rng.integers(1, VOCAB, b.size, dtype=np.int32))
    assert len(sched.running) == n and sched.num_retractions == 0, "setup did not reach steady state"
    return sched, wl


# ------------------------------------------------------------------------------ timing
class Samples:
    """Per-call CPU and wall times in ns. (A plain class, not a dataclass: a dataclass fails when
    this file is imported by path without registering it in sys.modules, as a smoke test may.)"""

    def __init__(self, cpu_ns: list[int], wall_ns: list[int]) -> None:
        self.cpu_ns = cpu_ns
        self.wall_ns = wall_ns

    def stats(self) -> dict[str, float]:
        def pct(xs: list[int], q: float) -> float:
            s = sorted(xs)
            return s[min(len(s) - 1, round(q * (len(s) - 1)))] / 1e3

        return {
            "median_us": statistics.median(self.cpu_ns) / 1e3,
            "p90_us": pct(self.cpu_ns, 0.9),
            "mean_us": statistics.fmean(self.cpu_ns) / 1e3,
            "wall_median_us": statistics.median(self.wall_ns) / 1e3,
            "wall_p90_us": pct(self.wall_ns, 0.9),
            "reps": len(self.cpu_ns),
        }


def bench_decode(sched: BatchScheduler, reps: int, warmup: int, seed: int) -> dict[str, Samples]:
    """Time ``schedule()`` and ``process()`` of ``reps`` decode steps at a fixed running count."""
    n = len(sched.running)
    assert not sched.waiting and sched.chunked is None
    tokens = [np.random.default_rng(seed + i).integers(1, VOCAB, n, dtype=np.int32) for i in range(8)]
    out = {k: Samples([], []) for k in ("schedule", "process", "step")}
    pc, wc = time.process_time_ns, time.perf_counter_ns
    gc.collect()
    for i in range(warmup + reps):
        tok = tokens[i % 8]
        w0, c0 = wc(), pc()
        batch = sched.schedule()
        c1, w1 = pc(), wc()
        sched.process(batch, tok)
        c2, w2 = pc(), wc()
        assert batch is not None and batch.mode is ForwardMode.DECODE and batch.size == n
        if i >= warmup:
            for key, c, w in (("schedule", c1 - c0, w1 - w0), ("process", c2 - c1, w2 - w1)):
                out[key].cpu_ns.append(c)
                out[key].wall_ns.append(w)
            out["step"].cpu_ns.append(c2 - c0)
            out["step"].wall_ns.append(w2 - w0)
    assert len(sched.running) == n and sched.num_retractions == 0, "left steady state"
    return out


def _kv_state(sched: BatchScheduler) -> tuple[int, ...]:
    kv = sched.kv
    return (
        kv.allocator.num_free_pages,
        kv.cache.evictable_size,
        kv.cache.protected_size,
        kv.req_to_token.num_free,
        len(sched.running),
        len(sched.waiting),
    )


def undo_prefill(sched: BatchScheduler, batch: ScheduleBatch, waiting: list[Req], consecutive: int) -> None:
    """Put the scheduler back as it was before ``schedule()`` returned ``batch`` (not processed)."""
    sched.in_flight.remove(batch)
    admitted = {id(r) for r in batch.reqs}
    sched.running = [r for r in sched.running if id(r) not in admitted]
    for r in batch.reqs:
        r.kv_len = r.cached_len  # nothing was computed: undo what schedule() committed
        r.drop_pending()
        sched.kv.release(r)  # frees the new pages, unlocks, frees the row
        r.admit_time = None
        r.num_cached_tokens = 0
    sched.waiting = list(waiting)
    sched.chunked = None
    sched.consecutive_prefills = consecutive


def bench_prefill(sched: BatchScheduler, reps: int, warmup: int) -> tuple[Samples, dict[str, float]]:
    """Time ``schedule()`` taking a prefill batch from the waiting queue, state restored each time."""
    waiting = list(sched.waiting)
    consecutive = sched.consecutive_prefills = 0  # a prefill is due (as after a decode step)
    before = _kv_state(sched)
    samples = Samples([], [])
    admitted, tokens = [], []
    pc, wc = time.process_time_ns, time.perf_counter_ns
    gc.collect()
    for i in range(warmup + reps):
        w0, c0 = wc(), pc()
        batch = sched.schedule()
        c1, w1 = pc(), wc()
        assert batch is not None and batch.mode is ForwardMode.EXTEND
        if i >= warmup:
            samples.cpu_ns.append(c1 - c0)
            samples.wall_ns.append(w1 - w0)
            admitted.append(batch.size)
            tokens.append(batch.num_tokens)
        undo_prefill(sched, batch, waiting, consecutive)
        assert _kv_state(sched) == before, "undo did not restore the KV state"
    info = {"admitted": statistics.median(admitted), "extend_tokens": statistics.median(tokens)}
    return samples, info


# ------------------------------------------------------------------------------ driver
def run_benchmark(
    ns: Sequence[int] = (64, 256, 1024),
    page_sizes: Sequence[int] = (1, 16),
    policies: Sequence[str] = ("lpm", "fcfs"),
    decode_reps: int = 400,
    prefill_reps: int = 200,
    warmup: int = 20,
    info_lpm_no_threshold: bool = True,
    check_invariants: bool = False,
    seed: int = 0,
) -> list[dict]:
    """Run every case; returns one row per (kind, op, n, page_size, policy) with stats in µs."""
    rows: list[dict] = []
    cases = [(p, "decode+prefill") for p in policies]
    if info_lpm_no_threshold:
        cases.append(("lpm-nothr", "prefill"))
    for ps in page_sizes:
        for n in ns:
            for policy_case, what in cases:
                common = {"n": n, "page_size": ps, "policy": policy_case}
                # Prefill scenario: n running (short max_new_tokens), n more waiting.
                sched, wl = build_scheduler(n, ps, policy_case, PREFILL_MAX_NEW, True, seed + n + ps)
                for r in wl.requests(n, PREFILL_MAX_NEW):
                    sched.add(r)
                nodes = len(sched.kv.cache.nodes())
                samples, info = bench_prefill(sched, prefill_reps, min(warmup, 5))
                if check_invariants:
                    sched.kv.check(sched.live_requests())
                stats = {**samples.stats(), **info, "tree_nodes": nodes}
                rows.append({"kind": "prefill", "op": "schedule", **common, **stats})
                del sched, wl
                if "decode" not in what:
                    continue
                # Decode scenario: n running, long max_new_tokens, nothing waiting.
                max_new = warmup + decode_reps + 64
                sched, _ = build_scheduler(n, ps, policy_case, max_new, False, seed + n + ps)
                nodes = len(sched.kv.cache.nodes())
                res = bench_decode(sched, decode_reps, warmup, seed)
                if check_invariants:
                    sched.kv.check(sched.live_requests())
                for op, s in res.items():
                    rows.append({"kind": "decode", "op": op, **common, **s.stats(), "tree_nodes": nodes})
                del sched
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'kind':8} {'op':9} {'ps':>3} {'policy':10} {'N':>5} {'median_us':>10} {'p90_us':>9}"
        f" {'wall_med':>9} {'admit':>6} {'tokens':>7} {'nodes':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["kind"], r["op"], r["page_size"], r["policy"], r["n"])):
        adm = f"{r['admitted']:.0f}" if "admitted" in r else ""
        tok = f"{r['extend_tokens']:.0f}" if "extend_tokens" in r else ""
        lines.append(
            f"{r['kind']:8} {r['op']:9} {r['page_size']:>3} {r['policy']:10} {r['n']:>5}"
            f" {r['median_us']:>10.1f} {r['p90_us']:>9.1f} {r['wall_median_us']:>9.1f}"
            f" {adm:>6} {tok:>7} {r['tree_nodes']:>6}"
        )
    return "\n".join(lines)


def target_verdict(rows: list[dict]) -> list[dict]:
    """Per case at N=256: decode step (schedule+process) and prefill schedule vs the 1 ms target."""
    out = []
    for r in rows:
        if r["n"] == TARGET_N and ((r["kind"], r["op"]) in {("decode", "step"), ("prefill", "schedule")}):
            out.append(
                {
                    "case": f"{r['kind']}/{r['op']} ps={r['page_size']} {r['policy']}",
                    "median_us": round(r["median_us"], 1),
                    "p90_us": round(r["p90_us"], 1),
                    "met_median": r["median_us"] < TARGET_US,
                    "met_p90": r["p90_us"] < TARGET_US,
                }
            )
    return sorted(out, key=lambda v: v["case"])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    panels = [("decode", ("schedule", "process", "step")), ("prefill", ("schedule",))]
    styles = {1: "-", 16: "--"}
    markers = {"lpm": "o", "fcfs": "s", "lpm-nothr": "^"}
    op_colors = {"schedule": "tab:blue", "process": "tab:green", "step": "tab:purple"}
    pol_colors = {"lpm": "tab:blue", "fcfs": "tab:orange", "lpm-nothr": "tab:red"}
    ns = sorted({r["n"] for r in rows})
    for ax, (kind, ops) in zip(axes, panels, strict=True):
        sel = [r for r in rows if r["kind"] == kind and r["op"] in ops]
        for op, ps, pol in sorted({(r["op"], r["page_size"], r["policy"]) for r in sel}):
            pts = sorted(
                (r["n"], r["median_us"], r["p90_us"])
                for r in sel
                if (r["op"], r["page_size"], r["policy"]) == (op, ps, pol)
            )
            x = [p[0] for p in pts]
            med = np.array([p[1] for p in pts])
            p90 = np.array([p[2] for p in pts])
            color = op_colors.get(op) if kind == "decode" else pol_colors.get(pol)
            label = f"{op} ps={ps} {pol}" if kind == "decode" else f"ps={ps} {pol}"
            ax.errorbar(
                x,
                med,
                yerr=[np.zeros_like(med), p90 - med],
                ls=styles.get(ps, "-"),
                marker=markers.get(pol, "o"),
                color=color,
                capsize=3,
                label=label,
                alpha=0.85,
            )
        ax.axhline(TARGET_US, color="red", lw=1, ls=":", label="1 ms target")
        ax.axvline(TARGET_N, color="grey", lw=0.5)
        ax.set_xscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("N running" + (" (and N waiting)" if kind == "prefill" else ""))
        title = "decode: schedule() / process() / both" if kind == "decode" else "prefill: schedule()"
        ax.set_title(f"{title}, median CPU time (bar to p90)", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if kind == "decode" else 1)
    axes[0].set_ylabel("µs per call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile_steps(
    n: int = 256, page_size: int = 1, policy: str = "lpm", steps: int = 200, top: int = 18
) -> str:
    """cProfile of ``steps`` decode steps and ``steps`` prefill schedules at ``n``; returns the report."""
    buf = io.StringIO()
    sched, _ = build_scheduler(n, page_size, policy, steps + 64, False, 7)
    tokens = np.random.default_rng(7).integers(1, VOCAB, n, dtype=np.int32)
    gc.collect()
    pr = cProfile.Profile()
    for _ in range(steps):
        pr.enable()
        batch = sched.schedule()
        sched.process(batch, tokens)
        pr.disable()
    case = f"ps={page_size}, {policy}, {steps} steps"
    buf.write(f"=== decode step (schedule+process), N={n} running, {case} ===\n")
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    sched, wl = build_scheduler(n, page_size, policy, PREFILL_MAX_NEW, True, 7)
    for r in wl.requests(n, PREFILL_MAX_NEW):
        sched.add(r)
    bench_prefill(sched, 2, 0)  # splits happen once
    waiting, before = list(sched.waiting), sched.consecutive_prefills
    pr = cProfile.Profile()
    for _ in range(steps):
        pr.enable()
        batch = sched.schedule()
        pr.disable()
        undo_prefill(sched, batch, waiting, before)
    buf.write(f"=== prefill schedule, N={n} waiting + {n} running, {case} ===\n")
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few repetitions, N in {64, 256} (smoke test)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the JSON and PNG")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the N=256 steps")
    args = ap.parse_args(argv)

    if args.quick:
        kw = {"ns": (64, 256), "decode_reps": 20, "prefill_reps": 10, "warmup": 3, "check_invariants": True}
    else:
        kw = {}
    t0 = time.perf_counter()
    rows = run_benchmark(**kw)
    table = format_table(rows)
    verdict = target_verdict(rows)
    print(table)
    print(f"\ntarget: < {TARGET_US:.0f} us per step at N={TARGET_N} (checked on the median and on p90)")
    for v in verdict:
        ok = {True: "ok", False: "MISSED"}
        print(f"  {v['case']:34} median {v['median_us']:8.1f} us {ok[v['met_median']]:6}"
              f"  p90 {v['p90_us']:8.1f} us {ok[v['met_p90']]}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "scheduler_overhead",
        "machine": machine_info(timer=TIMER_NOTE),
        "settings": {
            **kw,
            "quick": args.quick,
            "max_prompt": MAX_PROMPT,
            "prefill_max_new_tokens": PREFILL_MAX_NEW,
            "scheduler_defaults": {
                k: getattr(SchedulerConfig(**PREFILL_BUDGET), k) for k in DEFAULTS_RECORDED
            },
            "elapsed_s": round(time.perf_counter() - t0, 1),
        },
        "target": {"n": TARGET_N, "us": TARGET_US, "verdict": verdict},
        "results": rows,
    }
    (args.out / "scheduler_overhead.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, args.out / "scheduler_overhead.png")
    print(f"\nwrote {args.out / 'scheduler_overhead.json'} and {args.out / 'scheduler_overhead.png'}")
    if args.profile:
        print(profile_steps())
    return 0


if __name__ == "__main__":
    sys.exit(main())
