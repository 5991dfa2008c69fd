"""offline.png: throughput per system, the engine's host time per step, overlap / normal per pair."""

from __future__ import annotations

import statistics
from pathlib import Path

import _common as common

from .analysis import TARGET_SPEEDUP


def plot(results: dict, path: Path, verdict: dict | None = None, host: dict | None = None) -> None:
    plt = common.pyplot()
    names = ["hf", "ours_normal", "ours_overlap"]
    labels = [f"HF generate\n(static B={results['hf']['batch_size']})", "ours\nnormal", "ours\noverlap"]
    tps = [results[n]["output_tok_s"] for n in names]
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [3, 2, 2]})
    bars = ax.bar(labels, tps, color=["#999999", "#4c72b0", "#55a868"])
    for i, (b, n, v) in enumerate(zip(bars, names, tps, strict=True)):
        each = results[n]["repeats_output_tok_s"]
        ax.plot([i] * len(each), each, "k.", alpha=0.6)  # every repeat; the bar is the median one
        txt = f"{v:.0f} tok/s"
        if n != "hf":
            txt += f"\n{results[n]['speedup_vs_hf']:.2f}x HF"
        ax.annotate(txt, (b.get_x() + b.get_width() / 2, max(v, *each)), ha="center", va="bottom", fontsize=9)
    ax.axhline(TARGET_SPEEDUP * tps[0], ls="--", color="#c44e52", lw=1)
    ax.text(-0.4, TARGET_SPEEDUP * tps[0], f" target {TARGET_SPEEDUP:.0f}x HF", va="bottom", color="#c44e52")
    ax.set_ylim(0, max(max(tps), TARGET_SPEEDUP * tps[0]) * 1.3)
    ax.set_ylabel("useful output tokens / s")
    ax.set_title("Offline throughput (bars: median repeat, dots: every repeat)")

    ours = names[1:]
    x = range(len(ours))
    width = 0.25
    for k, (key, lab) in enumerate(
        (("host_ms_per_step", "mean"), ("host_ms_p50", "p50"), ("host_ms_p99", "p99"))
    ):
        vals = [results[n][key] for n in ours]
        ax2.bar([i + (k - 1) * width for i in x], vals, width, label=lab)
    for i, n in enumerate(ours):
        ax2.annotate(
            f"{100 * results[n]['host_frac_of_wall']:.1f}% of wall",
            (i, results[n]["host_ms_p99"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax2.set_xticks(list(x), ["normal", "overlap"])
    ax2.set_ylabel("ms per engine step")
    ax2.set_title("Engine non-forward host time per step")
    ax2.legend(fontsize=8)

    # overlap / normal, every pair: this model, and the tiny one (inline as run, or forced threaded)
    series = [("small\noverlap", (verdict or {}).get("overlap_vs_normal_each", []))]
    if host:
        series += [
            ("tiny\noverlap", host["overlap_vs_normal_each"]),
            ("tiny overlap\nall threaded", host["overlap_thread_vs_normal_each"]),
        ]
    for i, (_, each) in enumerate(series):
        ax3.plot([i] * len(each), each, "o", color="#55a868", alpha=0.7)
        if each:
            ax3.annotate(
                f"median {statistics.median(each):.3f}", (i, max(each)), ha="center", va="bottom", fontsize=8
            )
    ax3.axhline(1.0, ls="--", color="#c44e52", lw=1)
    ax3.set_xticks(range(len(series)), [lab for lab, _ in series])
    ax3.set_xlim(-0.5, len(series) - 0.5)
    ax3.set_ylabel("overlap / normal output tok/s (same pair)")
    ax3.set_title("Overlap vs normal loop, every pair")
    common.save_figure(fig, path)
