"""``--host-bound-pairs``: normal / overlap loop pairs on the tiny demo model."""

from __future__ import annotations

import argparse
import statistics

import _common as common

from .runners import engine_args, run_ours
from .workload import build_workload, workload_summary

# The host-bound check: the tiny demo model (forwards ~1 ms, mostly op dispatch on the host), where
# the loop's own host work is a large share of a step. Shapes as measured on the dev machine.
HOST_BOUND = {
    "num_requests": 256,
    "input_range": (16, 64),
    "output_range": (64, 256),
    "max_running_requests": 64,
}


def host_bound(args: argparse.Namespace) -> dict:
    """Normal vs overlap on the tiny model (``HOST_BOUND``), ``--host-bound-pairs`` times in
    alternating order: the overlap loop as the engine runs it (short CPU forwards inline) and with
    every forward forced onto its worker thread (``cpu_overlap_thread_min_ms=0``), both as ratios to
    the normal loop of the same pair."""
    systems = {"normal": (False, None), "overlap": (True, None), "overlap_thread": (True, 0.0)}
    with common.demo_model_folder("tiny") as path:
        vocab = common.model_vocab_size(path)
        reqs = build_workload(
            HOST_BOUND["num_requests"],
            HOST_BOUND["input_range"],
            HOST_BOUND["output_range"],
            0.0,
            0,
            vocab,
            args.seed,
        )
        eargs = engine_args(reqs, HOST_BOUND["max_running_requests"])
        pairs = []
        for k in range(args.host_bound_pairs):
            names = list(systems) if k % 2 == 0 else list(systems)[::-1]
            runs = {}
            for name in names:
                overlap, min_ms = systems[name]
                rec, _ = run_ours(path, reqs, overlap, eargs, vocab, thread_min_ms=min_ms)
                runs[name] = {
                    key: rec[key]
                    for key in (
                        "output_tok_s",
                        "wall_s",
                        "steps",
                        "host_ms_per_step",
                        "outputs_exact",
                        "forwards_on_worker_thread",
                        "forwards_inline",
                    )
                }
            pairs.append(runs)
            print(
                f"host-bound pair {k}: "
                + ", ".join(f"{n} {r['output_tok_s']:.0f}" for n, r in runs.items())
                + " out tok/s",
                flush=True,
            )

    def ratio(name: str) -> list[float]:
        return [p[name]["output_tok_s"] / p["normal"]["output_tok_s"] for p in pairs]

    return {
        "model": "demo llama/tiny",
        "workload": workload_summary(reqs),
        "engine_args": eargs,
        "pairs": pairs,
        "overlap_vs_normal_each": ratio("overlap"),
        "overlap_vs_normal": statistics.median(ratio("overlap")),
        "overlap_thread_vs_normal_each": ratio("overlap_thread"),
        "overlap_thread_vs_normal": statistics.median(ratio("overlap_thread")),
    }
