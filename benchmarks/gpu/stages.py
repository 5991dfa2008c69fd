"""The benchmark's stages, most wanted figures first, and the report after each one.

A stage that raises is recorded (``failed: <error>``) and the next one runs: each engine is built
afresh, so one stage's failure (the HF baseline running out of memory, say) costs only its own
figures. After every stage the caller gets the report so far, marked ``partial`` until the last
stage is done, so a run cut short (a crash, a device command's time limit) keeps what it measured.
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import offline

from .decode import measure_decode
from .device import copy_bandwidth, release
from .throughput import measure_hf, measure_offline

# In the order they run: the decode figures and their floor first, throughput against HF next, the
# overlap comparison and the idle trace last.
STAGES = (
    "bandwidth",
    "decode_graphs",
    "decode_eager",
    "offline_overlap",
    "hf",
    "offline_normal",
    "gpu_trace",
)


Json = dict[str, Any]


@dataclass
class Measurements:
    """What a run measured so far; None where its stage has not run (or failed)."""

    status: dict[str, str] = field(default_factory=lambda: dict.fromkeys(STAGES, "pending"))
    bandwidth: Json | None = None  # copy_bandwidth
    graphs: Json | None = None  # measure_decode, CUDA graphs on
    eager: Json | None = None  # measure_decode, graphs off (with the kernel count)
    reqs: list[Json] = field(default_factory=list)  # the offline workload
    overlap: Json | None = None  # measure_offline, overlap loop
    hf: Json | None = None  # measure_hf
    normal: Json | None = None  # measure_offline, normal loop
    trace: list[Json] | None = None  # the GPU idle trace (overlap loop; empty on CPU)

    @property
    def partial(self) -> bool:
        return any(s != "done" for s in self.status.values())


def measure(
    args: argparse.Namespace, model_path: Path, vocab: int, after_stage: Callable[[Measurements], None]
) -> Measurements:
    """Every stage in ``args.stages`` in STAGES' order, ``after_stage`` called after each (and once
    before the first); the others stay "not run"."""
    m = Measurements()
    m.reqs = offline.build_workload(
        args.num_requests, tuple(args.input_range), tuple(args.output_range), 0.0, 0, vocab, args.seed
    )
    for name in STAGES:
        if name not in args.stages:
            m.status[name] = "not run"
    after_stage(m)
    for name in STAGES:
        if name not in args.stages:
            continue
        print(f"== stage {name}", flush=True)
        try:
            _STAGE_RUNS[name](m, args, model_path, vocab)
            m.status[name] = "done"
        except Exception as e:
            traceback.print_exc()
            m.status[name] = f"failed: {e!r}"[:500]
        _release(args.device)
        after_stage(m)
    return m


def _release(device: str) -> None:
    """Free the stage's engine; after a device error this may raise too, which must not end the run."""
    try:
        release(device)
    except Exception:
        traceback.print_exc()


def _bandwidth(m: Measurements, args: argparse.Namespace, model_path: Path, vocab: int) -> None:
    m.bandwidth = copy_bandwidth(args.device, args.copy_mib)
    print(f"copy bandwidth: {m.bandwidth['d2d_gbps']:.0f} GB/s", flush=True)


def _decode_graphs(m: Measurements, args: argparse.Namespace, model_path: Path, vocab: int) -> None:
    m.graphs = measure_decode(model_path, args, graphs=True, vocab=vocab)


def _decode_eager(m: Measurements, args: argparse.Namespace, model_path: Path, vocab: int) -> None:
    m.eager = measure_decode(model_path, args, graphs=False, vocab=vocab)


def _offline_overlap(m: Measurements, args: argparse.Namespace, model_path: Path, vocab: int) -> None:
    m.overlap, _ = measure_offline(model_path, m.reqs, args, overlap=True, trace=False)


def _hf(m: Measurements, args: argparse.Namespace, model_path: Path, vocab: int) -> None:
    m.hf = measure_hf(model_path, m.reqs, args)


def _offline_normal(m: Measurements, args: argparse.Namespace, model_path: Path, vocab: int) -> None:
    m.normal, _ = measure_offline(model_path, m.reqs, args, overlap=False, trace=False)


def _gpu_trace(m: Measurements, args: argparse.Namespace, model_path: Path, vocab: int) -> None:
    _, m.trace = measure_offline(model_path, m.reqs, args, overlap=True, trace=True)


_STAGE_RUNS: dict[str, Callable[[Measurements, argparse.Namespace, Path, int], Any]] = {
    "bandwidth": _bandwidth,
    "decode_graphs": _decode_graphs,
    "decode_eager": _decode_eager,
    "offline_overlap": _offline_overlap,
    "hf": _hf,
    "offline_normal": _offline_normal,
    "gpu_trace": _gpu_trace,
}
