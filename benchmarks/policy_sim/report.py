"""policy_sim.json: the cost model, every workload's settings, the scheduler's defaults and one row
per simulated setting."""

from __future__ import annotations

from dataclasses import asdict

from radixserve.scheduler.config import SchedulerConfig

from .cost_model import BANNER, COST_MODEL
from .workloads import (
    BURST,
    BURST_MEMORY,
    BURST_SCHED,
    FAIRNESS,
    POISSON,
    POISSON_MEMORY,
    POISSON_P,
    POISSON_P_QUICK,
    POISSON_RATE,
    POISSON_SCHED,
)


def document(results: list[dict], seed: int, quick: bool) -> dict:
    return {
        "note": BANNER,
        "cost_model": COST_MODEL,
        "seed": seed,
        "quick": quick,
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
                "p_values": POISSON_P_QUICK if quick else POISSON_P,
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
        # the simulator's own wall time is machine dependent: the JSON is reproducible without it
        "results": [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in results],
    }
