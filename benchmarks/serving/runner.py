"""Both systems on one cluster and one engine: every Poisson rate and closed-loop repeat run on each,
back to back, with the CPU the cluster used meanwhile."""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import _common as common
from _common import rate_label

from . import inprocess, served
from .analysis import median_summary, meter_record, public_record, summarize
from .settings import SYSTEMS


def _proc_cpu_s(pid: int) -> float:
    """A process's CPU time (all threads); NaN where unreadable."""
    seconds = common.proc_cpu_seconds(f"/proc/{pid}/stat")
    return float("nan") if seconds is None else seconds


def _cluster_cpu(cluster: Any) -> dict[str, float]:
    return {s.name: _proc_cpu_s(s.proc.pid) if s.proc else float("nan") for s in cluster.services}


class Run(NamedTuple):
    """One measurement's requests, run on each system in turn."""

    section: str  # "rates" (Poisson) or "concurrency" (closed loop)
    key: str  # the rate's label or the concurrency, as the JSON names it
    reqs: list[dict]
    concurrency: int  # closed-loop clients; 0 for a Poisson rate
    tag: str  # the in-process request ids' prefix


def schedule(
    workloads: list[list[dict]], closed: list[list[list[dict]]], args: argparse.Namespace
) -> list[Run]:
    """The Poisson rates, then each concurrency's repeats."""
    runs = [("rates", rate_label(r), reqs, 0) for r, reqs in zip(args.rates, workloads, strict=True)]
    runs += [
        ("concurrency", str(c), reqs, c)
        for c, per_repeat in zip(args.concurrency, closed, strict=True)
        for reqs in per_repeat
    ]
    return [Run(section, key, reqs, c, f"{section[0]}{k}") for k, (section, key, reqs, c) in enumerate(runs)]


@dataclass
class Systems:
    """The served cluster and the in-process engine, and each system's results so far."""

    cluster: Any
    engine: Any
    # per system: "rates" and "concurrency" (served: "cluster_start_s" too; inprocess: "overlap_loop")
    results: dict[str, dict]

    def drive(self, system: str, run: Run) -> tuple[list[dict], float]:
        """``run``'s requests through ``system``: its records and wall time."""
        if run.section == "rates" and system == "served":
            return asyncio.run(served.run_rate_served(self.cluster.url, run.reqs))
        if run.section == "rates":
            return inprocess.run_rate_inprocess(self.engine, run.reqs, run.tag)
        if system == "served":
            return asyncio.run(served.run_closed_served(self.cluster.url, run.reqs, run.concurrency))
        return inprocess.run_closed_inprocess(self.engine, run.reqs, run.concurrency, run.tag)

    def measure(self, system: str, run: Run, order: int) -> None:
        """``run`` on ``system``, its summary stored with the CPU the cluster used meanwhile; raises
        if a served process exited."""
        cpu0 = _cluster_cpu(self.cluster)
        with common.Meter() as m:
            records, wall = self.drive(system, run)
        cpu1 = _cluster_cpu(self.cluster)
        cpu = {n: cpu1[n] - cpu0[n] for n in cpu1}
        summary = {**summarize(records, wall), **meter_record(m), "order": order}
        what = f"rate {run.key}" if run.section == "rates" else f"concurrency {run.key}"
        if system == "served":
            dead = [s.name for s in self.cluster.services if not s.alive()]
            summary.update(_served_health(records, cpu, dead))
            _store(self.results[system][run.section], run.key, run.section, summary, records)
            if dead:
                raise RuntimeError(f"served: {dead} exited during {what}")
        else:
            summary["cluster_cpu_s_meanwhile"] = sum(cpu.values())
            _store(self.results[system][run.section], run.key, run.section, summary, records)
        _progress(system, what, summary)


def _served_health(records: list[dict], cpu: dict[str, float], dead: list[str]) -> dict:
    """What a served run adds to its summary: each service's CPU, the requests whose SSE chunks
    carried several tokens, the first errors and the services that exited."""
    return {
        "service_cpu_s": cpu,
        "requests_multi_token_chunks": sum(r["ok"] and r["chunks"] != r["output_tokens"] for r in records),
        "chunk_tokens_estimated_requests": sum(
            r["ok"] and not r.get("chunk_tokens_exact", True) for r in records
        ),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "dead_services": dead,
    }


def run_both(
    model_path: Path,
    workloads: list[list[dict]],
    closed: list[list[list[dict]]],
    eargs: dict,
    args: argparse.Namespace,
) -> dict:
    """Both systems on one cluster and one engine: the Poisson rates, then the closed-loop
    concurrencies (``closed[k][rep]``: each concurrency ``--repeats`` times, a fresh draw each), every
    pair alternating which system goes first (ABBA: slow drifts in the machine's background load hit
    both alike). The cluster idles while the in-process engine runs (its CPU
    use then is recorded as ``cluster_cpu_s_meanwhile``) and the engine idles in between."""
    import torch

    from radixserve import Engine
    from radixserve.launcher import build_cluster, free_port

    torch.set_num_threads(args.threads)
    cluster = build_cluster(
        Path(model_path),
        common.MODEL_NAME,
        port=free_port(),
        schedulers=1,
        scheduler_args=common.scheduler_flags(eargs),
        torch_threads=args.threads,
    )
    t = time.perf_counter()
    cluster.start()
    systems = Systems(
        cluster,
        None,
        results={
            "served": {"cluster_start_s": time.perf_counter() - t, "rates": {}, "concurrency": {}},
            "inprocess": {"rates": {}, "concurrency": {}},
        },
    )
    try:
        systems.engine = Engine(str(model_path), **eargs)
        systems.results["inprocess"]["overlap_loop"] = systems.engine.loop.overlap
        asyncio.run(served.warm_served(cluster.url, args.vocab_size))
        common.warm_engine(systems.engine, args.vocab_size)
        for k, run in enumerate(schedule(workloads, closed, args)):
            order = SYSTEMS if k % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                systems.measure(system, run, order.index(system))
    finally:
        cluster.stop()
        if systems.engine is not None:
            systems.engine.shutdown()
    systems.engine = None  # drop the engine before gc
    gc.collect()
    for res in systems.results.values():
        for entry in res["concurrency"].values():
            entry["summary"] = median_summary([r["summary"] for r in entry["repeats"]])
    return systems.results


def _store(section_results: dict, key: str, section: str, summary: dict, records: list[dict]) -> None:
    """A Poisson rate runs once; a concurrency once per repeat (its summary: the repeats' medians)."""
    run = {"summary": summary, "requests": [public_record(r) for r in records]}
    if section == "rates":
        section_results[key] = run
    else:
        section_results.setdefault(key, {"repeats": []})["repeats"].append(run)


def _progress(system: str, what: str, s: dict) -> None:
    print(
        f"{system:9} {what:>14}: {s['completed']}/{s['completed'] + s['failed']} ok,"
        f" {s['output_tok_s']:.1f} out tok/s, TTFT p50 {s['ttft_ms_p50']:.0f} ms,"
        f" ITL p50 {s['itl_ms_p50']:.1f} ms, TPOT p50 {s['tpot_ms_p50']:.1f} ms,"
        f" makespan {s['makespan_s']:.1f} s",
        flush=True,
    )
