"""Decode step time at batch 1, 8 and 64 on the normal loop, with CUDA graphs on or off: host time
per step, and on CUDA the GPU's own time per step and its idle gap between steps."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import _common as common
import offline

from .kernels import count_kernels
from .model import make_engine

BATCH_SIZES = (1, 8, 64)


def time_decode(
    engine: Any, batch_size: int, args: argparse.Namespace, rng: Any, vocab: int
) -> dict[str, Any]:
    """``batch_size`` requests decode together; every decode step of all of them is timed."""
    from radixserve.scheduler.batch import ForwardMode

    def prompts() -> list[list[int]]:
        return [common.random_token_ids(rng, vocab, args.prompt_len) for _ in range(batch_size)]

    # untimed: this batch size's first prefill and decode (allocator growth, lazy kernel setup)
    engine.generate(input_ids=prompts(), sampling_params=offline.greedy(3))
    rows: list[tuple[float, int]] = []

    def timed(step: Any) -> None:  # the host time of every decode step of all the requests
        for b in step.batches:
            batch = b.batch
            if batch.mode is ForwardMode.DECODE and batch.size == batch_size:
                rows.append((b.processed - b.launched, int((batch.prefix_lens + batch.extend_lens).sum())))

    engine.loop.enable_gpu_trace()  # CUDA events around every forward (a no-op on CPU)
    try:
        params = offline.greedy(args.decode_steps)
        engine.generate(input_ids=prompts(), sampling_params=params, on_step=timed)
        traced = engine.loop.gpu_trace()
    finally:
        engine.loop.trace = None
    ms = [1e3 * s for s, _ in rows]
    return {
        "batch_size": batch_size,
        "steps_timed": len(ms),
        "median_ms": statistics.median(ms) if ms else float("nan"),
        "p10_ms": common.percentile(ms, 10),
        "p90_ms": common.percentile(ms, 90),
        "min_ms": min(ms, default=float("nan")),
        "kv_tokens_read_median": statistics.median(c for _, c in rows) if rows else float("nan"),
        **gpu_step_times(traced, batch_size),
    }


def gpu_step_times(traced: list[dict[str, Any]], batch_size: int) -> dict[str, Any]:
    """The GPU's own time per decode step of all ``batch_size`` requests (CUDA events around the
    forward: what the host time above leaves out is scheduling, preparing and processing) and its
    idle time before each such step; None on CPU, where nothing is traced."""
    steps = [s for s in traced if s["mode"] == "decode" and s["batch_size"] == batch_size]
    gpu = [float(s["gpu_ms"]) for s in steps]
    idle = [float(s["idle_before_ms"]) for s in steps if s["idle_before_ms"] is not None]
    return {
        "gpu_steps_timed": len(gpu),
        "gpu_median_ms": statistics.median(gpu) if gpu else None,
        "gpu_p90_ms": common.percentile(gpu, 90) if gpu else None,
        "gpu_idle_median_ms": statistics.median(idle) if idle else None,
    }


def decode_capacity(args: argparse.Namespace) -> int:
    """KV slots for the decode runs: the largest batch at full length, twice (a run's prefixes stay
    cached while the next runs), and a margin."""
    per_req = args.prompt_len + max(args.decode_steps, args.profile_steps + 8) + 2 * args.page_size
    return int(2 * max(BATCH_SIZES) * per_req + 64 * args.page_size)


def measure_decode(model_path: Path, args: argparse.Namespace, graphs: bool, vocab: int) -> dict[str, Any]:
    """Decode step times at every batch size on one engine; with graphs off also the kernel count."""
    import numpy as np

    rng = np.random.default_rng(args.seed + (1 if graphs else 2))
    engine = make_engine(
        model_path,
        args,
        graphs=graphs,
        overlap=False,
        max_running=max(BATCH_SIZES),
        max_total_tokens=decode_capacity(args),
    )
    try:  # the engine warmed itself up (EngineConfig.warmup): prefill, decode, every sampling path
        mc = engine.model_config
        out: dict[str, Any] = {
            "attention_backend": engine.runner.backend.name,
            "cuda_graphs_enabled": engine.profile.cuda_graph,
            "num_layers": mc.num_layers,
            "weight_bytes": sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()),
            "kv_bytes_per_token": mc.kv_bytes_per_token(),
            "engine_startup_s": engine.startup,  # load, graph capture, warm-up
            "by_batch_size": {},
        }
        for b in BATCH_SIZES:
            r = time_decode(engine, b, args, rng, vocab)
            out["by_batch_size"][str(b)] = r
            print(
                f"decode {'graphs' if graphs else 'eager '} bs {b:>2}: {r['median_ms']:.3f} ms median"
                f" over {r['steps_timed']} steps",
                flush=True,
            )
        out["graph_replays"] = engine.runner.graphs.replays  # evidence graphs ran
        if not graphs:
            out["kernels"] = count_kernels(engine, args, rng, vocab)
    finally:
        engine.shutdown()
    return out
