"""The whole benchmark: one workload, every configuration at every rate, the highest rate repeated,
and the report (configuration, machine, runs, targets)."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import _common as common
from _common import rate_label
from _machine import machine_info

from .analysis import compare, judge_saturation, overall, saturation_lite
from .runner import run_config
from .settings import BASELINE, POLICY, gateway_defaults
from .workload import at_rate, build_workload, kv_tokens, workload_summary


def pod_engine_args(args: argparse.Namespace, wl: dict) -> dict:
    """Every pod's engine arguments: KV for ``--kv-prefixes`` tenant prefixes (or
    ``--max-total-tokens``), then any ``--engine-arg``."""
    plens = [len(x) for x in wl["prefixes"]]
    total = args.max_total_tokens or kv_tokens(plens, args.kv_prefixes, args.page_size)
    eargs: dict[str, Any] = dict(
        page_size=args.page_size,
        max_total_tokens=total,
        max_running_requests=args.max_running_requests,
    )
    for kv in args.engine_arg:
        name, _, value = kv.partition("=")
        eargs[name] = value
    return eargs


def describe_config(args: argparse.Namespace, eargs: dict, summary: dict) -> dict:
    """The report's ``config``: what was run, and how."""
    return {
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
        "gateway_defaults": gateway_defaults(),
        "sampling": "greedy (temperature 0), ignore_eos, max_tokens = output length",
        "prompts": "tenant prefix (random token ids) + unique random suffix, sent as token ids",
        "arrivals": "Poisson (exponential gaps, first at t=0), the same draw scaled to each rate",
        "decision_latency": "in-process replay of router.choose per request prompt with the pods'"
        " sampled loads; cache-aware: InMemoryPrefixIndex fed the pods' real KV block events;"
        " +redis: RedisPrefixIndex on the live Redis the pods published to",
        "workload": summary,
    }


class ConfigChain:
    """Configurations one after another, each on a fresh cluster: the one before is stopped in the
    background while the next starts (``run_config`` waits for it before sending traffic)."""

    def __init__(self, model_path: Path, eargs: dict, args: argparse.Namespace) -> None:
        self.model_path, self.eargs, self.args = model_path, eargs, args
        self.stopper: threading.Thread | None = None

    def run(self, name: str, wl: dict, label: str, time_routing: bool = True) -> dict:
        res, self.stopper = run_config(
            name, self.model_path, wl, self.eargs, self.args, self.stopper, label, time_routing
        )
        return res

    def join(self) -> None:
        """Wait for the last cluster to stop."""
        if self.stopper is not None:
            self.stopper.join()


def run_rate(chain: ConfigChain, wl: dict, rate: float, configs: list[str]) -> dict:
    """Every configuration at one offered rate, and its verdict vs round-robin."""
    label = rate_label(rate)
    wl_r = at_rate(wl, 1.0, rate)
    results = {name: chain.run(name, wl_r, label=f"{label} req/s ") for name in configs}
    return {"rate": label, "results": results, "verdict": compare(results)}


def repeat_saturation(chain: ConfigChain, wl: dict, top: dict, args: argparse.Namespace) -> None:
    """The highest rate again (baseline and cache-aware configs), alternating the order, for a
    throughput ratio paired within each repeat; ``top`` (that rate's run) gets the judgement."""
    rate = args.rates[-1]
    names = [n for n in args.configs if n == BASELINE or POLICY[n] == "cache-aware"]
    if BASELINE not in names:  # nothing to pair with (parse_args always adds the baseline)
        return
    repeats = [{n: saturation_lite(top["results"][n]) for n in names}]
    for k in range(1, args.saturation_repeats):
        again = {}
        for name in names[::-1] if k % 2 else names:
            label = f"{top['rate']} req/s repeat {k}: "
            again[name] = saturation_lite(chain.run(name, at_rate(wl, 1.0, rate), label, time_routing=False))
        repeats.append(again)
    judge_saturation(top, repeats)


def sweep(model_path: Path, wl: dict, eargs: dict, args: argparse.Namespace) -> list[dict]:
    """Every rate (increasing), then the highest one's repeats."""
    chain = ConfigChain(model_path, eargs, args)
    try:
        runs = [run_rate(chain, wl, rate, args.configs) for rate in args.rates]
        repeat_saturation(chain, wl, runs[-1], args)
    finally:
        chain.join()
    return runs


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
        eargs = pod_engine_args(args, wl)
        summary = workload_summary(wl, args.page_size)
        config = describe_config(args, eargs, summary)
        print(
            f"{args.schedulers} pods, {args.tenants} tenants, {args.num_requests} requests"
            f" at {' '.join(map(rate_label, args.rates))} req/s"
            f" (last arrival {summary['last_arrival_s'] / args.rates[0]:.1f} s at the lowest),"
            f" engine args {eargs}, configs {args.configs}",
            flush=True,
        )
        runs = sweep(model_path, wl, eargs, args)
        report: dict[str, Any] = {
            "benchmark": "routing: cache-aware vs least-load vs round-robin across scheduler pods",
            "config": config,
            "machine": machine,
            "runs": runs,
            "targets": overall(runs),
        }
        return common.finish_report(report, t_start)
