"""The whole benchmark: the workloads of every rate and concurrency, both systems on them, and the
report (configuration, machine, results, verdict)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common as common
from _common import rate_label
from _machine import machine_info

from .analysis import compare
from .runner import run_both
from .workload import (
    build_closed_workload,
    build_workload,
    closed_seed,
    engine_args,
    rate_seed,
    workload_summary,
)


def draw_workloads(args: argparse.Namespace) -> tuple[list[list[dict]], list[list[list[dict]]]]:
    """One Poisson workload per rate, and per concurrency one closed-loop workload per repeat
    (``closed[k][rep]``), each a fresh draw."""
    workloads = [
        build_workload(
            args.num_requests,
            rate,
            tuple(args.input_range),
            tuple(args.output_range),
            args.vocab_size,
            rate_seed(args.seed, k),
        )
        for k, rate in enumerate(args.rates)
    ]
    closed = [
        [
            build_closed_workload(
                c,
                args.requests_per_client,
                tuple(args.input_range),
                tuple(args.output_range),
                args.vocab_size,
                closed_seed(args.seed, k, rep),
            )
            for rep in range(args.repeats)
        ]
        for k, c in enumerate(args.concurrency)
    ]
    return workloads, closed


def describe_config(
    args: argparse.Namespace, eargs: dict, workloads: list[list[dict]], closed: list[list[list[dict]]]
) -> dict:
    """The report's ``config``: what was run, and how."""
    labels = [rate_label(r) for r in args.rates]
    conc = [str(c) for c in args.concurrency]
    return {
        "model": common.model_description(args),
        "quick": args.quick,
        "seed": args.seed,
        "torch_threads": args.threads,
        "rates": labels,
        "num_requests_per_rate": args.num_requests,
        "input_range": list(args.input_range),
        "output_range": list(args.output_range),
        "engine_args": eargs,
        "scheduler_flags": common.scheduler_flags(eargs),
        "sampling": "greedy (temperature 0), ignore_eos, max_tokens = output length",
        "prompts": "random token ids (special ids avoided), a fresh draw per rate; sent as token ids",
        "arrivals": "Poisson (exponential gaps, first at t=0); inf = all at t=0",
        "itl_definition": "per token: a chunk/step carrying k tokens after a gap g gives k samples g/k;"
        " served chunks are 1 token each when chunk count == usage.completion_tokens, else the surplus"
        " goes to the chunks with non-ASCII text (chunk_tokens)",
        "workloads": {lab: workload_summary(w) for lab, w in zip(labels, workloads, strict=True)},
        "concurrency": conc,
        "requests_per_client": args.requests_per_client,
        "closed_loop": "C clients, client j runs requests j, j+C, j+2C, ... back to back (served: the"
        " next HTTP request as soon as the previous stream ended; in-process: the next Req added"
        " right after the step that finished the previous one); same prompts and lengths in both"
        " systems, a fresh draw per concurrency and repeat; each concurrency runs --repeats times,"
        " the two systems back to back each time (alternating which goes first), and the latency"
        " added is the median over repeats of the paired differences",
        "closed_loop_repeats": args.repeats,
        "closed_loop_workloads": {
            c: [workload_summary(w) for w in ws] for c, ws in zip(conc, closed, strict=True)
        },
    }


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    machine = machine_info()
    with common.model_folder(args) as model_path:
        args.vocab_size = common.model_vocab_size(model_path)
        workloads, closed = draw_workloads(args)
        eargs = engine_args(
            workloads,
            args.max_running_requests,
            closed=[(c, w) for c, ws in zip(args.concurrency, closed, strict=True) for w in ws],
        )
        config = describe_config(args, eargs, workloads, closed)
        labels, conc = config["rates"], config["concurrency"]
        print(
            f"rates {labels}, {args.num_requests} requests each; closed loop at concurrency {conc},"
            f" {args.requests_per_client} requests per client; engine args {eargs}",
            flush=True,
        )
        results = run_both(model_path, workloads, closed, eargs, args)
        report: dict[str, Any] = {
            "benchmark": "online serving: radixserve serve (HTTP SSE) vs the in-process Engine",
            "config": config,
            "machine": machine,
            "results": results,
            "verdict": compare(results, labels, conc),
        }
        report["machine"]["torch_threads"] = args.threads
        return common.finish_report(report, t_start)
