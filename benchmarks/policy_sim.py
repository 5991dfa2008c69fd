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

    python benchmarks/policy_sim.py [--quick] [--out DIR] [--seed N]

Library use (the smoke test imports this file by path)::

    run(workload, policy, fairness_timeout=None, *, p=None, seed=0, quick=False, check_every=0) -> dict
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.memory.manager import MemoryConfig
from radixserve.scheduler.req import Req

# ------------------------------------------------------------------ cost model
STEP_OVERHEAD_S = 5e-3  # fixed per engine step
PREFILL_PER_TOKEN_S = 1e-4  # per computed (extend) token: 0.1 ms
DECODE_PER_REQ_S = 5e-5  # per request in a decode batch: 0.05 ms
ATTN_PER_KV_TOKEN_S = 2e-7  # per KV token read by attention, both modes: 0.2 us
COST_MODEL = {
    "kind": "cost model (virtual time), NOT a GPU forward pass",
    "formula": "step_s = overhead + prefill_per_token*sum(extend_lens) + decode_per_req*batch_size[decode]"
    " + attn_per_kv_token*sum(prefix_lens + extend_lens)",
    "step_overhead_s": STEP_OVERHEAD_S,
    "prefill_per_token_s": PREFILL_PER_TOKEN_S,
    "decode_per_req_s": DECODE_PER_REQ_S,
    "attn_per_kv_token_s": ATTN_PER_KV_TOKEN_S,
}
BANNER = (
    "forward pass = COST MODEL in virtual time (no GPU, no model); the scheduler, cache and policies are real"
)

VOCAB = 128_256
ARRIVAL_EPS_S = 1e-6

# ------------------------------------------------------------------ workloads
BURST = {
    "num_shared": 24,
    "num_unrelated": 8,
    "system_prompt_len": 2000,
    "question_len": (20, 60),
    "unrelated_len": (2020, 2060),
    "output_len": (64, 128),
}
BURST_MEMORY = MemoryConfig(max_total_tokens=9000, page_size=1, max_running_requests=64, max_context_len=4096)
BURST_SCHED = {"chunked_prefill_size": 4096, "max_prefill_tokens": 8192, "max_running_requests": 64}

POISSON = {
    "num_requests": 400,
    "num_requests_quick": 120,
    "system_prompt_lens": (1000, 1300, 1600, 2000),
    "question_len": (20, 200),
    "unrelated_len": (1000, 2000),
    "output_len": (32, 256),
}
# Arrival rate (requests per virtual second) per shared-prefix rate p, chosen by hand from
# calibration runs (seed 0): fcfs p50 wait ~0.5-2 s, p99 ~3-5 s. About 15% more load and
# fcfs waits grow without bound; about 25% less and the queue is nearly always empty, so
# every policy looks the same (the engine is "busy" ~100% either way: it always has decodes).
POISSON_RATE = {0.25: 4.0, 0.5: 5.0, 0.75: 7.0, 0.9: 8.0}
POISSON_P = (0.25, 0.5, 0.75, 0.9)
POISSON_P_QUICK = (0.5,)
POISSON_MEMORY = MemoryConfig(
    max_total_tokens=16000, page_size=1, max_running_requests=128, max_context_len=4096
)
POISSON_SCHED = {"chunked_prefill_size": 4096, "max_prefill_tokens": 8192, "max_running_requests": 128}

# Fairness timeouts (virtual seconds), ~0.5x / 1x / 2x / 4x a typical lpm wait on each workload.
FAIRNESS = {"burst32": (0.8, 1.6, 3.2, 6.4), "poisson": (0.5, 1.0, 2.0, 4.0)}


@dataclass(frozen=True)
class Spec:
    rid: str
    prompt: np.ndarray
    max_new_tokens: int
    arrival_time: float
    group: str  # "shared0", "shared1", ... or "unrelated"
    shared_len: int  # tokens of the shared system prompt it starts with (0: none)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32)


def make_burst32(seed: int) -> list[Spec]:
    rng = np.random.default_rng([seed, 32])
    b = BURST
    system = _tokens(rng, b["system_prompt_len"])
    kinds = np.array(["shared"] * b["num_shared"] + ["unrelated"] * b["num_unrelated"])
    kinds = kinds[rng.permutation(len(kinds))]
    specs = []
    for i, kind in enumerate(kinds):
        out = int(rng.integers(b["output_len"][0], b["output_len"][1] + 1))
        if kind == "shared":
            q = _tokens(rng, int(rng.integers(b["question_len"][0], b["question_len"][1] + 1)))
            prompt, group, shared = np.concatenate([system, q]), "shared0", len(system)
        else:
            prompt = _tokens(rng, int(rng.integers(b["unrelated_len"][0], b["unrelated_len"][1] + 1)))
            group, shared = "unrelated", 0
        specs.append(Spec(f"b{i:02d}", prompt, out, i * ARRIVAL_EPS_S, group, shared))
    return specs


def make_poisson(seed: int, p: float, n: int, rate: float) -> list[Spec]:
    rng = np.random.default_rng([seed, 7, round(p * 1000)])
    c = POISSON
    systems = [_tokens(rng, n_) for n_ in c["system_prompt_lens"]]
    t = 0.0
    specs = []
    for i in range(n):
        t += float(rng.exponential(1.0 / rate))
        out = int(rng.integers(c["output_len"][0], c["output_len"][1] + 1))
        if rng.random() < p:
            k = int(rng.integers(len(systems)))
            q = _tokens(rng, int(rng.integers(c["question_len"][0], c["question_len"][1] + 1)))
            prompt, group, shared = np.concatenate([systems[k], q]), f"shared{k}", len(systems[k])
        else:
            prompt = _tokens(rng, int(rng.integers(c["unrelated_len"][0], c["unrelated_len"][1] + 1)))
            group, shared = "unrelated", 0
        specs.append(Spec(f"p{i:04d}", prompt, out, t, group, shared))
    return specs


def optimum_cached_tokens(specs: list[Spec]) -> int:
    """Most prompt tokens any order could serve from cache: every token of the prompt trie computed once.

    Sorting the prompts makes each one's longest common prefix with any other a neighbour's;
    sum of adjacent LCPs = total tokens - trie nodes (capped so each request computes >= 1 token).
    """
    prompts = sorted(tuple(s.prompt.tolist()) for s in specs)
    total = 0
    for a, b in itertools.pairwise(prompts):
        n = min(len(a), len(b))
        k = next((i for i in range(n) if a[i] != b[i]), n)
        total += min(k, len(b) - 1)
    return total


# ------------------------------------------------------------------ simulation
def step_time(batch) -> float:
    t = STEP_OVERHEAD_S + ATTN_PER_KV_TOKEN_S * float((batch.prefix_lens + batch.extend_lens).sum())
    if batch.mode is ForwardMode.EXTEND:
        t += PREFILL_PER_TOKEN_S * float(batch.extend_lens.sum())
    else:
        t += DECODE_PER_REQ_S * batch.size
    return t


def simulate(
    specs: list[Spec], config: SchedulerConfig, seed: int, check_every: int = 0, start_time: float = 0.0
) -> dict:
    """Run the workload to completion; returns finished requests and engine counters.

    The engine's first step is at ``start_time`` (burst32 starts once the whole burst is queued).
    """
    clock = [start_time]
    sched = BatchScheduler(config, clock=lambda: clock[0])
    rng = np.random.default_rng([seed, 99])
    reqs = [
        Req(s.rid, s.prompt, SamplingParams(max_new_tokens=s.max_new_tokens), arrival_time=s.arrival_time)
        for s in specs
    ]
    finished: list[Req] = []
    i = n_steps = n_prefill = 0
    busy = queued = 0.0
    step_times = []
    while i < len(reqs) or not sched.idle:
        while i < len(reqs) and reqs[i].arrival_time <= clock[0]:
            sched.add(reqs[i])
            i += 1
        batch = sched.schedule()
        if batch is None:
            if i < len(reqs):
                clock[0] = max(clock[0], reqs[i].arrival_time)
                continue
            raise AssertionError(
                f"engine stuck at t={clock[0]:.3f}: not idle but schedule() returned None "
                f"(waiting={len(sched.waiting)}, running={len(sched.running)}, chunked={sched.chunked})"
            )
        dt = step_time(batch)
        n_steps += 1
        n_prefill += batch.mode is ForwardMode.EXTEND
        step_times.append(dt)
        busy += dt
        queued += dt * len(sched.waiting)
        clock[0] += dt
        finished += sched.process(batch, _tokens(rng, batch.size))
        if check_every and n_steps % check_every == 0:
            sched.kv.check(sched.live_requests())
    assert len(finished) == len(reqs), f"{len(finished)} of {len(reqs)} requests finished"
    assert all(r.admit_time is not None for r in finished)
    sched.kv.check([])
    assert sched.kv.available() == sched.kv.capacity, (sched.kv.available(), sched.kv.capacity)
    return {
        "finished": finished,
        "makespan_s": clock[0],
        "busy_s": busy,
        "queued_req_s": queued,
        "steps": n_steps,
        "prefill_steps": n_prefill,
        "step_times": np.asarray(step_times),
        "retractions": sched.num_retractions,
    }


def _metrics(specs: list[Spec], sim: dict, fairness_timeout: float | None) -> dict:
    by_rid = {r.rid: r for r in sim["finished"]}
    reqs = [by_rid[s.rid] for s in specs]
    prompt = np.array([r.prompt_len for r in reqs], dtype=np.int64)
    cached = np.array([r.num_cached_tokens for r in reqs], dtype=np.int64)
    wait = np.array([r.admit_time - r.arrival_time for r in reqs])
    out_tokens = sum(len(r.output_ids) for r in reqs)
    st = sim["step_times"]
    m = {
        "num_requests": len(reqs),
        "hit_rate": float(cached.sum() / prompt.sum()),
        "hit_rate_optimum": float(optimum_cached_tokens(specs) / prompt.sum()),
        "wait_p50_s": float(np.percentile(wait, 50)),
        "wait_p99_s": float(np.percentile(wait, 99)),
        "wait_max_s": float(wait.max()),
        "throughput_tok_s": out_tokens / sim["makespan_s"],
        "makespan_s": sim["makespan_s"],
        "utilisation": sim["busy_s"] / sim["makespan_s"],
        "mean_waiting_reqs": sim["queued_req_s"] / sim["makespan_s"],
        "steps": sim["steps"],
        "prefill_steps": sim["prefill_steps"],
        "mean_step_s": float(st.mean()),
        "max_step_s": float(st.max()),
        "retractions": sim["retractions"],
        "output_tokens": out_tokens,
    }
    shared = [(s, by_rid[s.rid]) for s in specs if s.shared_len]
    if shared:
        hit = sum(min(r.num_cached_tokens, s.shared_len) for s, r in shared)
        tot = sum(s.shared_len for s, _ in shared)
        groups: dict[str, int] = {}
        for s, _ in shared:
            groups[s.group] = groups.get(s.group, 0) + s.shared_len
        # One compulsory miss per distinct shared prompt.
        compulsory = sum(next(s.shared_len for s, _ in shared if s.group == g) for g in groups)
        m["shared_prefix_hit_rate"] = hit / tot
        m["shared_prefix_hit_rate_optimum"] = (tot - compulsory) / tot
    if fairness_timeout is not None:
        overdue = np.maximum(0.0, wait - fairness_timeout)
        m["max_overdue_s"] = float(overdue.max())
        m["max_overdue_mean_steps"] = float(overdue.max() / st.mean())
        m["num_overdue_beyond_one_max_step"] = int((overdue > st.max()).sum())
        # The rule fairness actually enforces: once a request is overdue, no younger request is
        # admitted before it. Count (r, q) pairs with q younger, admitted first, while r was overdue.
        arr = np.array([r.arrival_time for r in reqs])
        adm = wait + arr
        younger_first = (arr[None, :] > arr[:, None]) & (adm[None, :] < adm[:, None])
        r_overdue = adm[None, :] - arr[:, None] > fairness_timeout
        m["overtaken_while_overdue"] = int((younger_first & r_overdue).sum())
        # What is left once capacity is taken out: delay from the moment a request is both overdue
        # and the oldest one not yet admitted (every older request admitted) to its admission.
        order = np.argsort(arr, kind="stable")
        older_adm = np.maximum.accumulate(np.concatenate([[-np.inf], adm[order][:-1]]))
        hol = np.empty_like(adm)
        hol[order] = adm[order] - np.maximum(arr[order] + fairness_timeout, older_adm)
        m["max_hol_overdue_s"] = float(max(0.0, hol.max()))
        m["max_hol_overdue_mean_steps"] = m["max_hol_overdue_s"] / float(st.mean())
    return m


def _config(workload: str, policy: str, fairness_timeout: float | None) -> SchedulerConfig:
    mem, extra = (BURST_MEMORY, BURST_SCHED) if workload == "burst32" else (POISSON_MEMORY, POISSON_SCHED)
    return SchedulerConfig(memory=mem, policy=policy, fairness_timeout=fairness_timeout, **extra)


def _rate(p: float) -> float:
    if p in POISSON_RATE:
        return POISSON_RATE[p]
    ps = sorted(POISSON_RATE)  # interpolate between the calibrated points
    return float(np.interp(p, ps, [POISSON_RATE[x] for x in ps]))


def _specs(workload: str, seed: int, p: float | None, quick: bool) -> list[Spec]:
    if workload == "burst32":
        return make_burst32(seed)
    if workload == "poisson":
        if p is None:
            raise ValueError("the poisson workload needs p (shared-prefix rate)")
        n = POISSON["num_requests_quick" if quick else "num_requests"]
        return make_poisson(seed, p, n, _rate(p))
    raise ValueError(f"unknown workload {workload!r}; choose burst32 or poisson")


def run(
    workload: str,
    policy: str,
    fairness_timeout: float | None = None,
    *,
    p: float | None = None,
    seed: int = 0,
    quick: bool = False,
    check_every: int = 0,
) -> dict:
    """Simulate one (workload, policy) setting; returns a flat dict of settings and metrics.

    workload: "burst32" or "poisson" (which needs ``p``); policy: "fcfs" | "lpm" | "dfs-weight";
    fairness_timeout: virtual seconds or None (off); quick: the smaller poisson stream;
    check_every: run ``kv.check`` on live requests every N steps (0: only at the end).
    """
    specs = _specs(workload, seed, p, quick)
    config = _config(workload, policy, fairness_timeout)
    t0 = time.perf_counter()
    start = specs[-1].arrival_time if workload == "burst32" else 0.0  # the burst is queued as one
    sim = simulate(specs, config, seed, check_every, start)
    res = {
        "workload": workload,
        "p": p,
        "policy": policy,
        "fairness_timeout": fairness_timeout,
        "label": policy if fairness_timeout is None else f"{policy}+fair{fairness_timeout:g}s",
        "seed": seed,
        "arrival_rate": None if workload == "burst32" else len(specs) / specs[-1].arrival_time,
        "nominal_rate": None if workload == "burst32" else _rate(p),
    }
    res.update(_metrics(specs, sim, fairness_timeout))
    res["sim_wall_s"] = time.perf_counter() - t0
    return res


def settings(workload: str) -> list[tuple[str, float | None]]:
    return [
        ("fcfs", None),
        ("lpm", None),
        *(("lpm", t) for t in FAIRNESS[workload]),
        ("dfs-weight", None),
    ]


# ------------------------------------------------------------------ output
# (header, width, format, value) per column; a None value prints "-".
COLUMNS = [
    ("hit%", 6, ".1f", lambda r: 100 * r["hit_rate"]),
    (
        "shrd%",
        6,
        ".1f",
        lambda r: 100 * r["shared_prefix_hit_rate"] if "shared_prefix_hit_rate" in r else None,
    ),
    ("p50 w", 7, ".2f", lambda r: r["wait_p50_s"]),
    ("p99 w", 7, ".2f", lambda r: r["wait_p99_s"]),
    ("max w", 7, ".2f", lambda r: r["wait_max_s"]),
    ("overdue", 7, ".2f", lambda r: r.get("max_overdue_s")),
    ("ov/stp", 6, ".1f", lambda r: r.get("max_overdue_mean_steps")),
    ("ovtk", 4, "d", lambda r: r.get("overtaken_while_overdue")),
    ("hol", 5, ".2f", lambda r: r.get("max_hol_overdue_s")),
    ("hol/s", 5, ".1f", lambda r: r.get("max_hol_overdue_mean_steps")),
    ("stp ms", 6, ".1f", lambda r: 1000 * r["mean_step_s"]),
    ("maxstp", 6, ".0f", lambda r: 1000 * r["max_step_s"]),
    ("tok/s", 7, ".0f", lambda r: r["throughput_tok_s"]),
    ("time s", 7, ".1f", lambda r: r["makespan_s"]),
    ("steps", 6, "d", lambda r: r["steps"]),
    ("retr", 5, "d", lambda r: r["retractions"]),
    ("q.avg", 5, ".1f", lambda r: r["mean_waiting_reqs"]),
]
HEADER = f"{'policy':<18}" + "".join(f" {h:>{w}}" for h, w, _, _ in COLUMNS)


def _fmt_row(r: dict) -> str:
    cells = []
    for _, w, fmt, get in COLUMNS:
        v = get(r)
        cells.append(f" {'-':>{w}}" if v is None else f" {v:>{w}{fmt}}")
    return f"{r['label']:<18}" + "".join(cells)


def print_table(results: list[dict]) -> None:
    print(BANNER)
    print(
        "hit% = cached/prompt tokens at first admission; shrd% = hits on the shared system prompt;"
        " w = queue wait (admit - arrival), virtual s\n"
        "overdue = max over requests of max(0, wait - fairness_timeout); ov/stp = overdue / mean step;"
        " ovtk = (older, younger) pairs where the younger was admitted while the older was overdue;\n"
        "hol = max delay from 'overdue AND all older requests admitted' to admission; hol/s: in mean steps\n"
        "stp ms / maxstp = mean / max step time (ms); q.avg = time-averaged waiting requests"
    )
    key = None
    for r in results:
        k = (r["workload"], r["p"])
        if k != key:
            key = k
            if r["workload"] == "burst32":
                title = f"\n== burst32  (hit% ceiling {100 * r['hit_rate_optimum']:.1f}"
                title += f", shared-prefix ceiling {100 * r['shared_prefix_hit_rate_optimum']:.1f})"
            else:
                title = (
                    f"\n== poisson p={r['p']}  ({r['num_requests']} req, nominal {r['nominal_rate']:g} req/s"
                    f" (measured {r['arrival_rate']:.2f}),"
                    f" hit% ceiling {100 * r['hit_rate_optimum']:.1f})"
                )
            print(title)
            print(HEADER)
        print(_fmt_row(r))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    poisson_ps = sorted({r["p"] for r in results if r["workload"] == "poisson"})
    panels = [("burst32", None), *(("poisson", p) for p in poisson_ps)]
    ncols = 3
    nrows = math.ceil((len(panels) + 1) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    fair_colors = ["#d9b3ff", "#b366ff", "#7a1fd1", "#3d0073"]  # light -> dark: shorter -> longer timeout
    for ax, (wl, p) in zip(axes.flat, panels, strict=False):
        rs = [r for r in results if r["workload"] == wl and r["p"] == p]
        timeouts = sorted({r["fairness_timeout"] for r in rs if r["fairness_timeout"] is not None})
        # Draw large markers first so coinciding results stay visible as concentric rings.
        for k, r in enumerate(rs):
            if r["fairness_timeout"] is not None:
                c, mk = fair_colors[timeouts.index(r["fairness_timeout"]) % len(fair_colors)], "D"
            else:
                c, mk = {
                    "fcfs": ("tab:red", "s"),
                    "lpm": ("tab:blue", "o"),
                    "dfs-weight": ("tab:green", "^"),
                }[r["policy"]]
            ax.scatter(
                100 * r["hit_rate"],
                r["wait_p99_s"],
                s=150 - 15 * k,
                marker=mk,
                facecolors="none",
                edgecolors=c,
                linewidths=1.6,
                zorder=3,
                label=f"{r['label']}: {100 * r['hit_rate']:.1f}%, {r['wait_p99_s']:.2f}s",
            )
        if rs:
            ax.axvline(
                100 * rs[0]["hit_rate_optimum"], color="grey", ls="--", lw=0.8, label="hit-rate ceiling"
            )
        ax.legend(fontsize=6.5, loc="best", framealpha=0.8, markerscale=0.6)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.margins(x=0.15, y=0.15)
        ax.set_title(wl if p is None else f"poisson p={p}", fontsize=10)
        ax.set_xlabel("prefix-cache hit rate (%)  [dashed: ceiling]")
        ax.set_ylabel("p99 queue wait (virtual s, log)")
        ax.grid(alpha=0.3)
    rest = list(axes.flat)[len(panels) :]
    if rest and any(r["workload"] == "poisson" for r in results):
        ax = rest[0]
        rest = rest[1:]
        for lab in dict.fromkeys(r["label"] for r in results if r["workload"] == "poisson"):
            rs = sorted(
                (r for r in results if r["workload"] == "poisson" and r["label"] == lab), key=lambda r: r["p"]
            )
            ax.plot(
                [r["p"] for r in rs], [100 * r["hit_rate"] for r in rs], marker="o", ms=3, lw=1, label=lab
            )
        rs = sorted(
            (r for r in results if r["workload"] == "poisson" and r["label"] == "fcfs"), key=lambda r: r["p"]
        )
        ax.plot(
            [r["p"] for r in rs], [100 * r["hit_rate_optimum"] for r in rs], "k--", lw=0.8, label="ceiling"
        )
        ax.set_title("poisson: hit rate vs shared-prefix rate p", fontsize=10)
        ax.set_xlabel("p")
        ax.set_ylabel("hit rate (%)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in rest:
        ax.axis("off")
    fig.suptitle("radixserve schedule policies: " + BANNER, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller poisson sweep (smoke test)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    jobs = [("burst32", pol, ft, None) for pol, ft in settings("burst32")]
    jobs += [
        ("poisson", pol, ft, p)
        for p in (POISSON_P_QUICK if args.quick else POISSON_P)
        for pol, ft in settings("poisson")
    ]
    results = []
    for wl, pol, ft, p in jobs:
        try:
            results.append(run(wl, pol, ft, p=p, seed=args.seed, quick=args.quick))
        except Exception:
            print(
                f"FAILED: workload={wl} p={p} policy={pol} fairness_timeout={ft} seed={args.seed}",
                file=sys.stderr,
            )
            raise
    wall = time.perf_counter() - t0
    print_table(results)
    print(f"\n{len(results)} runs in {wall:.1f} s wall")

    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "note": BANNER,
        "cost_model": COST_MODEL,
        "seed": args.seed,
        "quick": args.quick,
        "virtual_time": True,
        "workloads": {
            "burst32": {
                "spec": BURST,
                "memory": asdict(BURST_MEMORY),
                "scheduler": BURST_SCHED,
                "fairness_timeouts_s": FAIRNESS["burst32"],
            },
            "poisson": {
                "spec": POISSON,
                "rates_req_per_s": {str(k): v for k, v in POISSON_RATE.items()},
                "p_values": POISSON_P_QUICK if args.quick else POISSON_P,
                "memory": asdict(POISSON_MEMORY),
                "scheduler": POISSON_SCHED,
                "fairness_timeouts_s": FAIRNESS["poisson"],
            },
        },
        "scheduler_defaults": {
            k: getattr(SchedulerConfig(), k)
            for k in (
                "lpm_fcfs_threshold",
                "dedup_min_tokens",
                "max_consecutive_prefills",
                "init_new_token_ratio",
            )
        },
        "results": [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in results],
    }
    (args.out / "policy_sim.json").write_text(json.dumps(doc, indent=1) + "\n")
    if not args.no_plot:
        plot(results, args.out / "policy_sim.png")
    print(
        f"wrote {args.out / 'policy_sim.json'}"
        + ("" if args.no_plot else f" and {args.out / 'policy_sim.png'}")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
