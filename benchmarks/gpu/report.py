"""One whole benchmark run: every measurement in order on one temporary model, then the report with
its headline figures, the memory floor, the sections behind them and the targets."""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common as common
import offline
from _machine import machine_info

from radixserve.common.demo_model import SHAPES

from .decode import BATCH_SIZES, measure_decode
from .device import copy_bandwidth, device_name, flashinfer_version, release
from .model import QWEN3_0_6B, build_model, tokenizer_vocab
from .throughput import NANO_VLLM, idle_stats, measure_hf, measure_offline

TRACE_KEEP = 2000  # GPU trace steps kept in the JSON
TARGETS = {"decode_vs_floor": 2.0, "kernels_per_layer": 15, "speedup_vs_hf": 10.0, "overlap_speedup": 1.15}


@dataclass
class Measurements:
    """What one run measured, before it is reported."""

    bandwidth: dict  # copy_bandwidth
    graphs: dict  # measure_decode, CUDA graphs on
    eager: dict  # measure_decode, graphs off (with the kernel count)
    reqs: list[dict]  # the offline workload
    overlap: dict  # measure_offline, overlap loop
    normal: dict  # measure_offline, normal loop
    trace: list[dict]  # the GPU idle trace (overlap loop; empty on CPU)
    hf: dict  # measure_hf


def run(args: argparse.Namespace) -> dict:
    import torch

    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        m = measure(args)
    finally:
        torch.set_num_threads(threads_before)
    return common.finish_report(build_report(args, m), t_start)


def measure(args: argparse.Namespace) -> Measurements:
    """Every measurement, in the docstring's order, each engine or model freed before the next."""
    with tempfile.TemporaryDirectory(prefix="radixserve-bench-gpu-") as tmp:
        model_path = build_model(Path(tmp) / "model", args.smoke, args.dtype, args.seed)
        vocab = tokenizer_vocab(model_path)
        bw = copy_bandwidth(args.device, args.copy_mib)
        print(f"copy bandwidth: {bw['d2d_gbps']:.0f} GB/s", flush=True)
        graphs = measure_decode(model_path, args, graphs=True, vocab=vocab)
        release(args.device)
        eager = measure_decode(model_path, args, graphs=False, vocab=vocab)
        release(args.device)

        reqs = offline.build_workload(
            args.num_requests, tuple(args.input_range), tuple(args.output_range), 0.0, 0, vocab, args.seed
        )
        ours_overlap, _ = measure_offline(model_path, reqs, args, overlap=True, trace=False)
        release(args.device)
        ours_normal, _ = measure_offline(model_path, reqs, args, overlap=False, trace=False)
        release(args.device)
        _, trace = measure_offline(model_path, reqs, args, overlap=True, trace=True)
        release(args.device)
        hf = measure_hf(model_path, reqs, args)
    return Measurements(bw, graphs, eager, reqs, ours_overlap, ours_normal, trace, hf)


def _decode_ms(run: dict, b: int) -> float:
    return run["by_batch_size"][str(b)]["median_ms"]


def build_report(args: argparse.Namespace, m: Measurements) -> dict:
    import torch

    cuda = args.device.startswith("cuda")
    kv_tokens = m.graphs["by_batch_size"]["1"]["kv_tokens_read_median"]
    floor_bytes = m.graphs["weight_bytes"] + m.graphs["kv_bytes_per_token"] * kv_tokens
    kern = m.eager["kernels"]
    per_step = kern["kernels_per_decode_step"]
    num_layers = m.eager["num_layers"]
    report: dict[str, Any] = {
        "benchmark": "GPU decode: step time vs memory floor, kernels per step, offline throughput vs HF",
        "device": device_name(args.device),
        "torch_version": torch.__version__,
        "flashinfer_version": flashinfer_version(),
        "attention_backend": m.graphs["attention_backend"],
        "cuda_graphs_used": m.graphs["cuda_graphs_enabled"],
        **{f"decode_ms_bs{b}": _decode_ms(m.graphs, b) for b in BATCH_SIZES},
        **{f"decode_ms_bs{b}_eager": _decode_ms(m.eager, b) for b in BATCH_SIZES},
        "floor_ms_bs1": 1e3 * floor_bytes / (m.bandwidth["d2d_gbps"] * 1e9),
        "d2d_gbps": m.bandwidth["d2d_gbps"],
        "kernels_per_decode_step": per_step,
        "num_layers": num_layers,
        "kernels_per_layer": None if per_step is None else per_step / num_layers,
        "kernel_count_method": kern["kernel_count_method"],
        "offline_tok_s": m.overlap["output_tok_s"],
        "hf_tok_s": m.hf["output_tok_s"],
        "speedup_vs_hf": m.overlap["output_tok_s"] / m.hf["output_tok_s"],
        **NANO_VLLM,
        "overlap_speedup": m.overlap["output_tok_s"] / m.normal["output_tok_s"],
        **idle_stats(m.trace),
        "gpu_trace": m.trace[:TRACE_KEEP],
        "config": run_config(args, m.reqs),
        "floor": {
            "weight_bytes": m.graphs["weight_bytes"],
            "kv_bytes_per_token": m.graphs["kv_bytes_per_token"],
            "kv_tokens_read_bs1_median": kv_tokens,
            "bytes_read_bs1": floor_bytes,
            **m.bandwidth,
        },
        "decode": {"graphs": m.graphs, "eager": m.eager},
        "kernels": kern,
        "offline": {"overlap": m.overlap, "normal": m.normal},
        "hf": m.hf,
        "machine": machine_info(cuda_device=device_name(args.device) if cuda else None),
    }
    report["targets"] = judge(report, cuda)
    return report


def run_config(args: argparse.Namespace, reqs: list[dict]) -> dict:
    """The report's ``config``: the model, every setting and the offline workload."""
    return {
        "model": "random-weight Qwen3, " + ("tiny shapes (--smoke)" if args.smoke else "Qwen3-0.6B shapes"),
        "model_shapes": dict(SHAPES["tiny"] if args.smoke else QWEN3_0_6B),
        "smoke": args.smoke,
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


def judge(r: dict, cuda: bool) -> dict:
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
