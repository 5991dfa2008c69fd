"""gpu-<device>.png: decode step times (host and GPU) against the floor, GPU idle between steps, offline
throughput; a stage that did not run draws as zero."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _common as common

from .decode import BATCH_SIZES
from .throughput import NANO_VLLM


def plot(report: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    x = range(len(BATCH_SIZES))
    w = 0.27
    series = (
        ("decode_ms_bs", "", "CUDA graphs, host", "#4c72b0"),
        ("decode_gpu_ms_bs", "", "CUDA graphs, GPU", "#8fb0dd"),
        ("decode_ms_bs", "_eager", "eager, host", "#dd8452"),
    )
    for k, (key, suffix, label, color) in enumerate(series):
        vals = [report[f"{key}{b}{suffix}"] or 0.0 for b in BATCH_SIZES]
        bars = ax.bar([i + (k - 1) * w for i in x], vals, w, label=label, color=color)
        for b, v in zip(bars, vals, strict=True):
            if v > 0:  # log scale: a missing figure (0) has no place on it
                ax.annotate(
                    f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7
                )
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
    tps = [  # 0 where a stage did not run (a partial report)
        report["hf_tok_s"] or 0.0,
        (off["normal"] or {}).get("output_tok_s", 0.0),
        (off["overlap"] or {}).get("output_tok_s", 0.0),
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
