"""GPU decode benchmark: how close the Engine's decode step is to the memory floor, how many kernels a
step launches, and the Engine's offline throughput against HF ``generate``, all in one process.

The model is random-weight Qwen3-0.6B shapes (28 layers, hidden 1024, 16 q / 8 kv heads of 128,
MLP 3072, vocab 151936, tied embeddings) in bfloat16, built with ``save_pretrained`` in a temporary
folder with the demo model's tokenizer (prompt ids are drawn below the tokenizer's vocab; the
model's vocab stays 151936). What is measured, in order:

* ``d2d_gbps``: device-to-device copy bandwidth, ``dst.copy_(src)`` of a 1 GiB tensor timed with
  ``torch.cuda.Event`` (best of a few rounds); a copy reads and writes, so 2 x bytes / time.
* ``decode_ms_bs{1,8,64}`` (CUDA graphs on) and ``..._eager`` (``disable_cuda_graph=True``): B
  requests with ``--prompt-len`` token prompts decode ``--decode-steps`` tokens together on the
  normal loop (``disable_overlap=True``), so a step is schedule + prepare + forward + sync +
  process; ``engine.loop.on_batch`` times every step and the median over the steps whose batch is
  a decode batch of all B requests is reported.
* ``floor_ms_bs1``: (bytes of every weight + bytes of KV one bs-1 decode step reads at the median
  context of the timed steps) / ``d2d_gbps``: the time just to read what a step must read.
* ``kernels_per_decode_step`` (and ``/ num_layers`` as ``kernels_per_layer``): with graphs off, a
  few decode steps under ``torch.profiler`` (CPU + CUDA activities); CUDA kernel events, memcpy and
  memset excluded, per step. ``kernel_count_method`` says what was counted.
* ``offline_tok_s`` / ``hf_tok_s``: ``--num-requests`` (256) requests with input and output lengths
  uniform in 100..1024 (seeded), greedy, ``ignore_eos``: ours is one ``Engine.generate`` call with
  all of them (overlap loop, graphs on); HF is ``AutoModelForCausalLM.generate`` in static,
  left-padded batches (benchmarks/offline.py's approach; the best of ``--hf-batch-sizes``), counting
  only each request's own output tokens. ``speedup_vs_hf`` = ours / HF. nano-vllm's published figure
  for the same workload (1434 tok/s, RTX 4070, a different GPU) is in the JSON for reference.
* ``overlap_speedup``: the same workload on the overlap loop over the normal loop.
* GPU idle trace: the workload again on the overlap loop with ``engine.loop.enable_gpu_trace()``;
  per step the GPU's busy time and its idle time since the previous step ended; reported as
  ``gpu_idle_ms_p50`` / ``p90``, ``gpu_idle_frac`` = idle / (idle + busy), and up to 2,000 steps.

    .venv/bin/python benchmarks/gpu.py [--device cuda] [--out DIR]
    .venv/bin/python benchmarks/gpu.py --smoke [--out DIR]       # tiny model on CPU, < 1 min
    radixserve bench gpu [same flags]

Writes DIR/gpu-<device>.json (e.g. gpu-nvidia-h200.json; default DIR benchmarks/results) and a PNG
beside it, with a ``targets`` dict (decode at bs 1 within 2x the floor, <= 15 kernels a layer, >= 10x
HF, overlap >= 1.15x the normal loop). The GPU figures come only from a run on a GPU machine.
``--smoke`` runs every part end to end on CPU with a tiny Qwen3 and tiny request counts so the
script is known to work: there the copy bandwidth is a host memcpy, the "kernel" count is top-level
torch ops per step, there is no GPU trace, and no target is judged.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_*.py
import _common as common
import offline
from _machine import machine_info

from radixserve.common.demo_model import SHAPES

BATCH_SIZES = (1, 8, 64)
TRACE_KEEP = 2000  # GPU trace steps kept in the JSON
NANO_VLLM = {"nano_vllm_published_tok_s": 1434, "nano_vllm_device": "RTX 4070"}
TARGETS = {"decode_vs_floor": 2.0, "kernels_per_layer": 15, "speedup_vs_hf": 10.0, "overlap_speedup": 1.15}

# Qwen3-0.6B's shapes (its config.json); the weights are random.
QWEN3_0_6B: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
)
FULL, SMOKE = common.presets(
    (  # (setting, full run, --smoke)
        ("prompt_len", 128, 16),
        ("decode_steps", 64, 6),
        ("profile_steps", 5, 3),
        ("num_requests", 256, 6),
        ("input_range", (100, 1024), (8, 24)),
        ("output_range", (100, 1024), (4, 12)),
        ("hf_batch_sizes", (64,), (3,)),
        ("max_running_requests", 256, 64),
        ("copy_mib", 1024, 32),
        ("threads", None, 1),
    )
)


# ------------------------------------------------------------------------------ model
def build_model(path: Path, smoke: bool, dtype: str, seed: int) -> Path:
    """A random-weight Qwen3 folder (Qwen3-0.6B's shapes, or tiny ones) with the demo tokenizer."""
    from transformers import Qwen3Config

    from radixserve.common.demo_model import model_config, save_random_model

    def config(vocab: int, ids: dict[str, Any]) -> Any:
        if smoke:  # the tiny demo model's shapes, vocab = the tokenizer's
            return model_config("qwen3", "tiny", vocab, ids, dtype)
        return Qwen3Config(dtype=dtype, **QWEN3_0_6B, **ids)

    return save_random_model(path, config, dtype, seed)


def tokenizer_vocab(model_path: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(model_path)))


# ----------------------------------------------------------------------------- engine
def make_engine(model_path: Path, args: argparse.Namespace, **kw: Any):
    """An Engine with this run's device, dtype and page size; ``kw``: graphs, overlap, max_running,
    max_total_tokens."""
    from radixserve import Engine

    return Engine(
        str(model_path),
        device=args.device,
        dtype=args.dtype,
        disable_cuda_graph=not kw["graphs"],
        cuda_graph_max_bs=kw["max_running"],
        disable_overlap=not kw["overlap"],
        max_running_requests=kw["max_running"],
        page_size=args.page_size,
        max_total_tokens=kw["max_total_tokens"],
        chunked_prefill_size=args.chunked_prefill_size,
    )


def release(device: str) -> None:
    """Free what a finished engine or model held (call after its last reference is gone)."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def greedy(max_new_tokens: int):
    from radixserve import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


# --------------------------------------------------------------------------- bandwidth
def copy_bandwidth(device: str, mib: int, rounds: int = 5, copies: int = 10) -> dict:
    """``dst.copy_(src)`` of ``mib`` MiB: 2 x bytes / time (a copy reads and writes), best round.

    CUDA: timed with ``torch.cuda.Event``s around ``copies`` back-to-back copies. CPU (--smoke): a
    host memcpy timed with ``perf_counter``.
    """
    import torch

    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    per_copy_s = []
    for _ in range(rounds):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(copies):
                dst.copy_(src)
            end.record()
            end.synchronize()
            per_copy_s.append(start.elapsed_time(end) / 1e3 / copies)
        else:
            t = time.perf_counter()
            for _ in range(copies):
                dst.copy_(src)
            per_copy_s.append((time.perf_counter() - t) / copies)
    del src, dst
    release(device)
    best = min(per_copy_s)
    return {
        "d2d_gbps": 2 * n / best / 1e9,
        "copy_bytes": n,
        "copy_ms_each_round": [1e3 * s for s in per_copy_s],
        "d2d_method": (
            f"{mib} MiB dst.copy_(src), torch.cuda.Event timing, {copies} copies a round, best of {rounds}"
            if device.startswith("cuda")
            else f"CPU memcpy stand-in: {mib} MiB dst.copy_(src), perf_counter, best of {rounds}"
        ),
    }


# ------------------------------------------------------------------------------ decode
def time_decode(engine: Any, batch_size: int, args: argparse.Namespace, rng: Any, vocab: int) -> dict:
    """``batch_size`` requests decode together; every decode step of all of them is timed."""
    from radixserve.scheduler.batch import ForwardMode

    def prompts() -> list[list[int]]:
        return [common.random_token_ids(rng, vocab, args.prompt_len) for _ in range(batch_size)]

    # untimed: this batch size's first prefill and decode (allocator growth, lazy kernel setup)
    engine.generate(input_ids=prompts(), sampling_params=greedy(3))
    rows: list[tuple[float, int]] = []

    def on_batch(batch: Any, launched: float, processed: float) -> None:
        if batch.mode is ForwardMode.DECODE and batch.size == batch_size:
            rows.append((processed - launched, int((batch.prefix_lens + batch.extend_lens).sum())))

    engine.loop.on_batch = on_batch
    try:
        engine.generate(input_ids=prompts(), sampling_params=greedy(args.decode_steps))
    finally:
        engine.loop.on_batch = None
    ms = [1e3 * s for s, _ in rows]
    return {
        "batch_size": batch_size,
        "steps_timed": len(ms),
        "median_ms": statistics.median(ms) if ms else float("nan"),
        "p10_ms": common.percentile(ms, 10),
        "p90_ms": common.percentile(ms, 90),
        "min_ms": min(ms, default=float("nan")),
        "kv_tokens_read_median": statistics.median(c for _, c in rows) if rows else float("nan"),
    }


def count_kernels(engine: Any, args: argparse.Namespace, rng: Any, vocab: int, batch_size: int = 1) -> dict:
    """Kernels (CUDA) or top-level torch ops (CPU) per decode step, under ``torch.profiler``.

    The requests are added to the scheduler and the loop is stepped by hand, so the profiled window
    holds exactly ``--profile-steps`` loop steps (all decode steps: checked and reported).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from radixserve.scheduler.batch import ForwardMode
    from radixserve.scheduler.req import Req

    warm = 2
    cuda = args.device.startswith("cuda")
    sp = greedy(warm + args.profile_steps + 4)
    for i in range(batch_size):
        p = replace(sp)
        p.validate()
        engine.scheduler.add(Req(f"profile{i}", common.random_token_ids(rng, vocab, args.prompt_len), p))
    modes: list[ForwardMode] = []
    engine.loop.on_batch = lambda batch, *_: modes.append(batch.mode)
    try:
        while sum(m is ForwardMode.DECODE for m in modes) < warm:
            engine.loop.step()
        sync(args.device)
        first = len(modes)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                engine.loop.step()
            sync(args.device)
        window = modes[first:]
        while engine.loop.busy:  # let the profiled requests finish
            engine.loop.step()
    finally:
        engine.loop.on_batch = None
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


def decode_capacity(args: argparse.Namespace) -> int:
    """KV slots for the decode runs: the largest batch at full length, twice (a run's prefixes stay
    cached while the next runs), and a margin."""
    per_req = args.prompt_len + max(args.decode_steps, args.profile_steps + 8) + 2 * args.page_size
    return 2 * max(BATCH_SIZES) * per_req + 64 * args.page_size


def measure_decode(model_path: Path, args: argparse.Namespace, graphs: bool, vocab: int) -> dict:
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


# ----------------------------------------------------------------------------- offline
def measure_hf(model_path: Path, reqs: list[dict], args: argparse.Namespace) -> dict:
    import torch

    model = offline.load_hf(model_path)
    try:
        model.to(device=args.device, dtype=getattr(torch, args.dtype))
        offline.hf_generate(model, [reqs[0]["input_ids"][:16]], 4)  # warm-up (untimed)
        sweep = []
        for b in args.hf_batch_sizes:
            sync(args.device)
            rec = offline.run_hf(model, reqs, b)  # ends with .tolist(): the device is done
            sweep.append(rec)
            print(f"hf B={b}: {rec['wall_s']:.1f}s, {rec['output_tok_s']:.1f} useful out tok/s", flush=True)
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
            input_ids=[r["input_ids"] for r in reqs], sampling_params=offline._sampling(reqs)
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


# ------------------------------------------------------------------------------ report
def device_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def flashinfer_version() -> str | None:
    try:
        import flashinfer
    except Exception:  # not installed (CPU machines), or its import failed
        return None
    return str(getattr(flashinfer, "__version__", "unknown"))


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


def plot(report: dict, path: Path) -> None:
    plt = common.pyplot()
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    x = range(len(BATCH_SIZES))
    w = 0.38
    for k, (suffix, label, color) in enumerate(
        (("", "CUDA graphs", "#4c72b0"), ("_eager", "eager", "#dd8452"))
    ):
        vals = [report[f"decode_ms_bs{b}{suffix}"] or 0.0 for b in BATCH_SIZES]
        bars = ax.bar([i + (k - 0.5) * w for i in x], vals, w, label=label, color=color)
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    if report["floor_ms_bs1"]:
        floor = report["floor_ms_bs1"]
        ax.hlines(floor, -0.5, 0.5, colors="#c44e52", linestyles="--", label=f"floor bs1 {floor:.3f} ms")
    ax.set_xticks(list(x), [f"bs {b}" for b in BATCH_SIZES])
    ax.set_yscale("log")
    ax.set_ylabel("decode step, ms (median)")
    ax.set_title(f"Decode step time ({report['device']})")
    ax.legend(fontsize=8)

    idle = [s["idle_before_ms"] for s in report["gpu_trace"] if s.get("idle_before_ms") is not None]
    if idle:
        ax2.hist(idle, bins=50, color="#55a868")
        ax2.set_xlabel("GPU idle before a step, ms")
        ax2.set_ylabel("steps")
        frac = report["gpu_idle_frac"]
        ax2.set_title(f"GPU idle between steps (overlap loop; idle share {100 * (frac or 0):.1f}%)")
    else:
        ax2.text(0.5, 0.5, "no GPU trace (CPU run)", ha="center", va="center", transform=ax2.transAxes)
        ax2.set_title("GPU idle between steps")
        ax2.set_xticks([])
        ax2.set_yticks([])

    names = [
        "HF generate",
        "ours normal",
        "ours overlap",
        f"nano-vllm\n(published, {NANO_VLLM['nano_vllm_device']})",
    ]
    off = report["offline"]
    tps = [
        report["hf_tok_s"],
        off["normal"]["output_tok_s"],
        off["overlap"]["output_tok_s"],
        NANO_VLLM["nano_vllm_published_tok_s"],
    ]
    bars = ax3.bar(names, tps, color=["#999999", "#4c72b0", "#55a868", "#cccccc"])
    bars[-1].set_hatch("//")
    for b, v in zip(bars, tps, strict=True):
        ax3.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax3.set_ylabel("output tokens / s")
    ax3.set_title(f"Offline throughput, {report['config']['num_requests']} requests")
    ax3.tick_params(axis="x", labelsize=8)
    common.save_figure(fig, path)


# --------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU, tiny counts: end to end in < 1 min"
    )
    p.add_argument("--device", default=None, help="cuda (default) or cpu (--smoke's default)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on CPU)")
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="engine default when unset")
    p.add_argument("--prompt-len", type=int, default=None, help=f"decode runs' prompt ({FULL['prompt_len']})")
    p.add_argument(
        "--decode-steps", type=int, default=None, help=f"tokens each decode run ({FULL['decode_steps']})"
    )
    p.add_argument("--profile-steps", type=int, default=None, help="decode steps under the profiler")
    p.add_argument(
        "--num-requests", type=int, default=None, help=f"offline workload ({FULL['num_requests']})"
    )
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None, help="HF static batches; best kept")
    p.add_argument("--max-running-requests", type=int, default=None, help="offline runs' engine limit")
    p.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth tensor size (1024)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (smoke: 1)")
    args = p.parse_args(argv)
    args.quick = args.smoke  # common.fill_defaults' switch
    common.fill_defaults(args, FULL, SMOKE)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    common.check_ranges(p, args, ["input_range", "output_range"])
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device here: run on a GPU machine, or pass --smoke (CPU)")
    return args


def run(args: argparse.Namespace) -> dict:
    import torch

    t_start = time.perf_counter()
    cuda = args.device.startswith("cuda")
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
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
    finally:
        torch.set_num_threads(threads_before)

    def decode_ms(run: dict, b: int) -> float:
        return run["by_batch_size"][str(b)]["median_ms"]

    kv_tokens = graphs["by_batch_size"]["1"]["kv_tokens_read_median"]
    floor_bytes = graphs["weight_bytes"] + graphs["kv_bytes_per_token"] * kv_tokens
    kern = eager["kernels"]
    per_step = kern["kernels_per_decode_step"]
    num_layers = eager["num_layers"]
    report: dict[str, Any] = {
        "benchmark": "GPU decode: step time vs memory floor, kernels per step, offline throughput vs HF",
        "device": device_name(args.device),
        "torch_version": torch.__version__,
        "flashinfer_version": flashinfer_version(),
        "attention_backend": graphs["attention_backend"],
        "cuda_graphs_used": graphs["cuda_graphs_enabled"],
        **{f"decode_ms_bs{b}": decode_ms(graphs, b) for b in BATCH_SIZES},
        **{f"decode_ms_bs{b}_eager": decode_ms(eager, b) for b in BATCH_SIZES},
        "floor_ms_bs1": 1e3 * floor_bytes / (bw["d2d_gbps"] * 1e9),
        "d2d_gbps": bw["d2d_gbps"],
        "kernels_per_decode_step": per_step,
        "num_layers": num_layers,
        "kernels_per_layer": None if per_step is None else per_step / num_layers,
        "kernel_count_method": kern["kernel_count_method"],
        "offline_tok_s": ours_overlap["output_tok_s"],
        "hf_tok_s": hf["output_tok_s"],
        "speedup_vs_hf": ours_overlap["output_tok_s"] / hf["output_tok_s"],
        **NANO_VLLM,
        "overlap_speedup": ours_overlap["output_tok_s"] / ours_normal["output_tok_s"],
        **idle_stats(trace),
        "gpu_trace": trace[:TRACE_KEEP],
        "config": {
            "model": "random-weight Qwen3, "
            + ("tiny shapes (--smoke)" if args.smoke else "Qwen3-0.6B shapes"),
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
        },
        "floor": {
            "weight_bytes": graphs["weight_bytes"],
            "kv_bytes_per_token": graphs["kv_bytes_per_token"],
            "kv_tokens_read_bs1_median": kv_tokens,
            "bytes_read_bs1": floor_bytes,
            **bw,
        },
        "decode": {"graphs": graphs, "eager": eager},
        "kernels": kern,
        "offline": {"overlap": ours_overlap, "normal": ours_normal},
        "hf": hf,
        "machine": machine_info(cuda_device=device_name(args.device) if cuda else None),
    }
    report["targets"] = judge(report, cuda)
    return common.finish_report(report, t_start)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path, png_path = common.write_outputs(
        args.out, f"gpu-{device_slug(report['device'])}", report, lambda path: plot(report, path)
    )
    keys = [f"decode_ms_bs{b}{s}" for s in ("", "_eager") for b in BATCH_SIZES]
    keys += ["floor_ms_bs1", "d2d_gbps", "kernels_per_decode_step", "kernels_per_layer"]
    keys += [
        "offline_tok_s",
        "hf_tok_s",
        "speedup_vs_hf",
        "overlap_speedup",
        "gpu_idle_ms_p50",
        "gpu_idle_frac",
    ]
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    print("targets:", json.dumps(report["targets"]))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
