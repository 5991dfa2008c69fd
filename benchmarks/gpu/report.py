"""One whole benchmark run: the stages in order on one temporary model, then the report with its
headline figures, the memory floor, the sections behind them and the targets. The report is built
after every stage too (``write``), with None for the figures not measured yet."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as common
import offline
from _machine import machine_info

from radixserve.common.demo_model import SHAPES

from .decode import BATCH_SIZES
from .device import device_name, flashinfer_version
from .model import SHAPES_BY_ARCH, build_model, tokenizer_vocab
from .stages import Measurements, measure
from .throughput import NANO_VLLM, idle_stats

TRACE_KEEP = 2000  # GPU trace steps kept in the JSON
MODELS = {  # --arch: (the model, its full-size shapes)
    "qwen3": ("Qwen3", "Qwen3-0.6B shapes"),
    "qwen3_moe": ("Qwen3-MoE", "Qwen3-0.6B's attention, 64 experts of 384 in every layer, 8 per token"),
}
TARGETS = {"decode_vs_floor": 2.0, "kernels_per_layer": 15, "speedup_vs_hf": 10.0, "overlap_speedup": 1.15}


def run(args: argparse.Namespace, write: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The whole run; ``write`` gets the report after every stage (and the final one)."""
    import torch

    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)

    def report(m: Measurements) -> dict[str, Any]:
        return common.finish_report(build_report(args, m), t_start)

    try:
        with tempfile.TemporaryDirectory(prefix="radixserve-bench-gpu-") as tmp:
            model_path = build_model(Path(tmp) / "model", args.smoke, args.dtype, args.seed, args.arch)
            vocab = tokenizer_vocab(model_path)
            m = measure(args, model_path, vocab, lambda m: write(report(m)) if write else None)
    finally:
        torch.set_num_threads(threads_before)
    return report(m)


def _per_batch(run: dict[str, Any] | None, b: int, key: str) -> Any:
    """A decode run's figure at batch size ``b``; None when that run did not happen."""
    return None if run is None else run["by_batch_size"][str(b)].get(key)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def decode_figures(m: Measurements) -> dict[str, Any]:
    """Host time per decode step (launch to processed tokens), the GPU's own time per step (CUDA
    events around the forward; None on CPU) and the GPU's idle gap before each step, graphs on and
    off; medians over the timed steps."""
    out: dict[str, Any] = {}
    for suffix, run in (("", m.graphs), ("_eager", m.eager)):
        for b in BATCH_SIZES:
            out[f"decode_ms_bs{b}{suffix}"] = _per_batch(run, b, "median_ms")
            out[f"decode_gpu_ms_bs{b}{suffix}"] = _per_batch(run, b, "gpu_median_ms")
            out[f"decode_gpu_idle_ms_bs{b}{suffix}"] = _per_batch(run, b, "gpu_idle_median_ms")
    return out


def floor_figures(m: Measurements) -> dict[str, Any]:
    """The bs-1 memory floor: every weight and the KV one step reads, at the copy bandwidth."""
    run = m.graphs or m.eager
    if run is None:
        return {}
    kv_tokens = run["by_batch_size"]["1"]["kv_tokens_read_median"]
    floor_bytes = run["weight_bytes"] + run["kv_bytes_per_token"] * kv_tokens
    return {
        "weight_bytes": run["weight_bytes"],
        "kv_bytes_per_token": run["kv_bytes_per_token"],
        "kv_tokens_read_bs1_median": kv_tokens,
        "bytes_read_bs1": floor_bytes,
        **(m.bandwidth or {}),
    }


def build_report(args: argparse.Namespace, m: Measurements) -> dict[str, Any]:
    """The report from what ``m`` holds: every key always present (None where not measured), the
    figures a reader wants first at the top."""
    import torch

    cuda = args.device.startswith("cuda")
    floor = floor_figures(m)
    gbps = (m.bandwidth or {}).get("d2d_gbps")
    kern = m.eager["kernels"] if m.eager else None
    per_step = kern["kernels_per_decode_step"] if kern else None
    num_layers = (m.eager or m.graphs or {}).get("num_layers")
    ours, hf, normal = (r["output_tok_s"] if r else None for r in (m.overlap, m.hf, m.normal))
    report: dict[str, Any] = {
        "benchmark": "GPU decode: step time vs memory floor, kernels per step, offline throughput vs HF",
        "partial": m.partial,
        "stages": dict(m.status),
        "device": device_name(args.device),
        **decode_figures(m),
        "floor_ms_bs1": 1e3 * floor["bytes_read_bs1"] / (gbps * 1e9) if floor and gbps else None,
        "d2d_gbps": gbps,
        "kernels_per_decode_step": per_step,
        "num_layers": num_layers,
        "kernels_per_layer": None if per_step is None or not num_layers else per_step / num_layers,
        "kernel_count_method": kern["kernel_count_method"] if kern else None,
        "offline_tok_s": ours,
        "hf_tok_s": hf,
        "speedup_vs_hf": _ratio(ours, hf),
        **NANO_VLLM,
        "overlap_speedup": _ratio(ours, normal),
        **idle_stats(m.trace or []),
        "gpu_trace": (m.trace or [])[:TRACE_KEEP],
        "torch_version": torch.__version__,
        "flashinfer_version": flashinfer_version(),
        "attention_backend": (m.graphs or m.eager or {}).get("attention_backend"),
        "cuda_graphs_used": m.graphs["cuda_graphs_enabled"] if m.graphs else None,
        "config": run_config(args, m.reqs),
        "floor": floor,
        "decode": {"graphs": m.graphs, "eager": m.eager},
        "kernels": kern,
        "offline": {"overlap": m.overlap, "normal": m.normal},
        "hf": m.hf,
        "machine": machine_info(cuda_device=device_name(args.device) if cuda else None),
    }
    report["targets"] = judge(report, cuda)
    return report


def run_config(args: argparse.Namespace, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's ``config``: the model, every setting and the offline workload."""
    return {
        "model": f"random-weight {MODELS[args.arch][0]}, "
        + ("tiny shapes (--smoke)" if args.smoke else MODELS[args.arch][1]),
        "model_shapes": dict(SHAPES["tiny"] if args.smoke else SHAPES_BY_ARCH[args.arch]),
        "smoke": args.smoke,
        "preset": "smoke" if args.smoke else args.preset,
        "stages_asked": list(args.stages),
        "device_arg": args.device,
        "dtype": args.dtype,
        "seed": args.seed,
        "page_size": args.page_size,
        "chunked_prefill_size": args.chunked_prefill_size,
        "batch_sizes": list(BATCH_SIZES),
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "profile_steps": args.profile_steps,
        "num_requests": args.num_requests,
        "input_range": list(args.input_range),
        "output_range": list(args.output_range),
        "hf_batch_sizes_tried": list(args.hf_batch_sizes),
        "max_running_requests": args.max_running_requests,
        "workload": offline.workload_summary(reqs),
        "sampling": "greedy (temperature 0), ignore_eos, max_new_tokens = output length",
    }


def judge(r: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """The targets, on a CUDA run only (None where a figure is missing, all None on CPU)."""

    def at_most(a: Any, b: Any) -> bool | None:
        return None if not cuda or a is None or b is None else bool(a <= b)

    floor2 = None if r["floor_ms_bs1"] is None else TARGETS["decode_vs_floor"] * r["floor_ms_bs1"]
    return {
        "decode_ms_bs1_le_2x_floor": at_most(r["decode_ms_bs1"], floor2),
        "kernels_per_layer_le_15": at_most(r["kernels_per_layer"], TARGETS["kernels_per_layer"]),
        "speedup_vs_hf_ge_10": at_most(TARGETS["speedup_vs_hf"], r["speedup_vs_hf"]),
        "overlap_speedup_ge_1_15": at_most(TARGETS["overlap_speedup"], r["overlap_speedup"]),
        "note": "judged on a CUDA run only" if cuda else "not judged: CPU (--smoke) run",
    }
