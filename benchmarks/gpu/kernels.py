"""Kernels per decode step: a few decode steps under ``torch.profiler``, graphs off."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import _common as common
import offline

from .device import sync


def count_kernels(engine: Any, args: argparse.Namespace, rng: Any, vocab: int, batch_size: int = 1) -> dict:
    """Kernels (CUDA) or top-level torch ops (CPU) per decode step, under ``torch.profiler``.

    The requests are added to the scheduler and the loop is stepped by hand, so the profiled window
    holds exactly ``--profile-steps`` loop steps (all decode steps: checked and reported).
    """
    from torch.autograd import DeviceType

    from radixserve.scheduler.batch import ForwardMode

    cuda = args.device.startswith("cuda")
    prof, window = profile_decode_steps(engine, args, rng, vocab, batch_size)
    decode_steps = sum(m is ForwardMode.DECODE for m in window)
    events = list(prof.events())
    if cuda:
        kernels = [e for e in events if _is_kernel(e)]
        launches = [e for e in events if e.device_type == DeviceType.CPU and "LaunchKernel" in e.name]
        method = (
            "torch.profiler (CPU + CUDA activities), CUDA graphs off: device-side CUDA kernel events"
            " (no memcpy / memset / annotations) per decode step"
        )
    else:
        kernels = [
            e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None and not e.is_async
        ]
        launches = []
        method = (
            "CPU stand-in (no GPU): torch.profiler CPU activity, top-level torch ops (profiler CPU events"
            " with no parent op) per decode step; not kernels"
        )
    # No kernel events at all means the profiler saw no device activity (CUPTI unavailable): no count,
    # rather than a zero that would pass the target.
    per_step = len(kernels) / decode_steps if decode_steps and kernels else None
    top: dict[str, int] = {}
    for e in kernels:
        top[e.name] = top.get(e.name, 0) + 1
    return {
        "kernels_per_decode_step": per_step,
        "kernel_count_method": method,
        "profiled_steps": len(window),
        "profiled_decode_steps": decode_steps,
        "profiled_batch_size": batch_size,
        "cuda_launch_api_calls_per_decode_step": len(launches) / decode_steps
        if cuda and decode_steps
        else None,
        "top_kernels_per_step": {
            k: round(v / max(1, decode_steps), 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:25]
        },
    }


def profile_decode_steps(
    engine: Any, args: argparse.Namespace, rng: Any, vocab: int, batch_size: int
) -> tuple[Any, list]:
    """``batch_size`` requests past two warm decode steps, then ``--profile-steps`` loop steps under
    the profiler; returns the profiler and the profiled steps' forward modes. The requests are run
    to the end afterwards, so the engine is idle again."""
    from torch.profiler import ProfilerActivity, profile

    from radixserve.scheduler.batch import ForwardMode
    from radixserve.scheduler.req import Req

    warm = 2
    sp = offline.greedy(warm + args.profile_steps + 4)
    for i in range(batch_size):
        p = replace(sp)
        p.validate()
        engine.scheduler.add(Req(f"profile{i}", common.random_token_ids(rng, vocab, args.prompt_len), p))
    modes: list[ForwardMode] = []

    def step() -> None:
        modes.extend(b.batch.mode for b in engine.loop.step().batches)

    while sum(m is ForwardMode.DECODE for m in modes) < warm:
        step()
    sync(args.device)
    first = len(modes)
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
        sync(args.device)
    window = modes[first:]
    while engine.loop.busy:  # let the profiled requests finish
        step()
    return prof, window


def _is_kernel(e: Any) -> bool:
    """A device-side kernel event: ``activity_type`` "kernel" where the profiler's events carry an
    activity type, else any CUDA-device event that is not a memcpy / memset."""
    from torch.autograd import DeviceType

    if e.device_type != DeviceType.CUDA:
        return False
    kind = getattr(e, "activity_type", None)
    if kind:
        return str(kind) == "kernel"
    return not e.name.startswith(("Memcpy", "Memset"))
