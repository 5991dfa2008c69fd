"""The simulation: the real ``BatchScheduler`` stepped in virtual time by the cost model, one
(workload, policy) setting at a time, and the sweep of every setting."""

from __future__ import annotations

import sys
import time

import numpy as np

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.batch_scheduler import BatchScheduler
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.req import Req

from .cost_model import step_time
from .metrics import metrics
from .workloads import (
    FAIRNESS,
    POISSON_P,
    POISSON_P_QUICK,
    Spec,
    make_specs,
    nominal_rate,
    random_tokens,
    scheduler_config,
)


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
        finished += sched.process(batch, random_tokens(rng, batch.size))
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
    specs = make_specs(workload, seed, p, quick)
    config = scheduler_config(workload, policy, fairness_timeout)
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
        "nominal_rate": None if workload == "burst32" else nominal_rate(p),
    }
    res.update(metrics(specs, sim, fairness_timeout))
    res["sim_wall_s"] = time.perf_counter() - t0
    return res


def settings(workload: str) -> list[tuple[str, float | None]]:
    return [
        ("fcfs", None),
        ("lpm", None),
        *(("lpm", t) for t in FAIRNESS[workload]),
        ("dfs-weight", None),
    ]


def run_sweep(seed: int, quick: bool) -> list[dict]:
    """Every setting: burst32, then poisson at each p (``quick``: one p), each with every policy."""
    jobs = [("burst32", pol, ft, None) for pol, ft in settings("burst32")]
    jobs += [
        ("poisson", pol, ft, p)
        for p in (POISSON_P_QUICK if quick else POISSON_P)
        for pol, ft in settings("poisson")
    ]
    results = []
    for wl, pol, ft, p in jobs:
        try:
            results.append(run(wl, pol, ft, p=p, seed=seed, quick=quick))
        except Exception:
            print(
                f"FAILED: workload={wl} p={p} policy={pol} fairness_timeout={ft} seed={seed}",
                file=sys.stderr,
            )
            raise
    return results
