"""Offline throughput: one ``Engine.generate`` of the whole workload (normal or overlap loop, optionally
with the GPU idle trace) against HF ``generate`` in static batches (benchmarks/offline's baseline)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _common as common
import offline

from .device import release, sync
from .model import make_engine

NANO_VLLM = {"nano_vllm_published_tok_s": 1434, "nano_vllm_device": "RTX 4070"}


def measure_hf(model_path: Path, reqs: list[dict], args: argparse.Namespace) -> dict:
    import torch

    model = offline.load_hf(model_path)
    try:
        model.to(device=args.device, dtype=getattr(torch, args.dtype))
        # each timed run starts on an idle device and ends with .tolist(): the device is done
        sweep = offline.hf_sweep(model, reqs, args.hf_batch_sizes, before_each=lambda: sync(args.device))
    finally:
        del model
        release(args.device)
    best = max(sweep, key=lambda r: r["output_tok_s"])
    return {**best, "sweep": sweep}


def measure_offline(model_path: Path, reqs: list[dict], args: argparse.Namespace, overlap: bool, trace: bool):
    """One ``Engine.generate`` of every request (graphs on); ``trace``: with the GPU idle trace on."""
    eargs = offline.engine_args(reqs, args.max_running_requests, args.page_size)
    engine = make_engine(
        model_path,
        args,
        graphs=True,
        overlap=overlap,
        max_running=eargs["max_running_requests"],
        max_total_tokens=eargs["max_total_tokens"],
    )
    try:  # warmed up by the engine itself
        if trace:
            engine.loop.enable_gpu_trace()
        sync(args.device)
        t = time.perf_counter()
        outs = engine.generate(
            input_ids=[r["input_ids"] for r in reqs], sampling_params=offline.greedy_sampling(reqs)
        )
        sync(args.device)
        wall = time.perf_counter() - t
        steps = engine.loop.gpu_trace() if trace else []
    finally:
        engine.shutdown()
    got = sum(len(o["token_ids"]) for o in outs)
    rec = {
        "loop": "overlap" if overlap else "normal",
        "wall_s": wall,
        "output_tokens": got,
        "output_tok_s": got / wall,
        "outputs_exact": all(len(o["token_ids"]) == r["output_len"] for o, r in zip(outs, reqs, strict=True)),
        "engine_args": eargs,
    }
    print(
        f"ours {rec['loop']}{' (traced)' if trace else ''}: {wall:.1f}s, {rec['output_tok_s']:.1f} out tok/s"
    )
    return rec, steps


def idle_stats(steps: list[dict]) -> dict:
    """Idle between steps (p50, p90) and the idle share of idle + busy; None without a trace."""
    idle = [float(s["idle_before_ms"]) for s in steps if s.get("idle_before_ms") is not None]
    busy = sum(float(s["gpu_ms"]) for s in steps)
    total = sum(idle) + busy
    return {
        "gpu_idle_ms_p50": common.percentile(idle, 50) if idle else None,
        "gpu_idle_ms_p90": common.percentile(idle, 90) if idle else None,
        "gpu_idle_frac": sum(idle) / total if steps and total > 0 else None,
        "gpu_trace_steps": len(steps),
        "gpu_busy_ms_total": busy if steps else None,
        "gpu_idle_ms_total": sum(idle) if steps else None,
    }
