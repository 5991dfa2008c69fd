"""The PNG: one panel per measure, offered rate on x, a line per configuration."""

from __future__ import annotations

from pathlib import Path

import _common as common

from .settings import POLICY, TARGET_DECISION_P99_MS


def plot(runs: list[dict], path: Path, ideal: float | None = None) -> None:
    """One panel per measure, offered rate on x, a line per configuration."""
    plt = common.pyplot()
    colors = {"cache-aware": "#4c72b0", "least-load": "#dd8452", "round-robin": "#8c8c8c"}
    colors["cache-aware+redis"] = "#55a868"
    labels = [r["rate"] for r in runs]
    x = list(range(len(runs)))
    names = list(runs[0]["results"])
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.6))
    panels = (
        (lambda res: res["summary"]["hit_rate"], "cache hit rate (cached / prompt tokens)", "fraction"),
        (lambda res: res["summary"]["output_tok_s"], "output throughput", "output tokens / s"),
        (lambda res: res["summary"]["ttft_ms_p90"], "TTFT p90", "ms (log)"),
        (
            lambda res: res["decision"]["decision_ms_p99"],
            "routing decision p99 (in-process replay)",
            "ms (log)",
        ),
    )
    for ax, (get, title, ylab) in zip(axes, panels, strict=True):
        for n in names:
            ys = [get(r["results"][n]) for r in runs]
            ax.plot(x, ys, "o-", color=colors.get(n, "#999999"), label=n)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylab)
        ax.set_xticks(x, labels)
        ax.set_xlabel("offered load, req/s (inf: all at t=0)")
    if ideal is not None:
        axes[0].axhline(ideal, color="k", ls=":", lw=1, label=f"ideal (one pod per tenant) {ideal:.2f}")
    axes[0].set_ylim(0, 1)
    axes[2].set_yscale("log")
    axes[3].set_yscale("log")
    axes[3].axhline(
        TARGET_DECISION_P99_MS, color="k", ls=":", lw=1, label=f"target < {TARGET_DECISION_P99_MS:g} ms"
    )
    for ax in (axes[0], axes[3]):
        ax.legend(fontsize=7)
    # ratios vs round-robin under the throughput and TTFT panels' titles
    for ax, key, fmt in ((axes[1], "output_tok_s_x", "{:.2f}x"), (axes[2], "ttft_p90_divisor", "/{:.1f}")):
        for n in names:
            if POLICY[n] != "cache-aware":
                continue
            for i, r in enumerate(runs):
                y = (
                    r["results"][n]["summary"]["output_tok_s"]
                    if key == "output_tok_s_x"
                    else r["results"][n]["summary"]["ttft_ms_p90"]
                )
                ax.annotate(
                    fmt.format(r["verdict"]["vs_round_robin"][n][key]),
                    (i, y),
                    fontsize=7,
                    xytext=(4, 4),
                    textcoords="offset points",
                    color=colors.get(n, "#999999"),
                )
    common.save_figure(fig, path)
