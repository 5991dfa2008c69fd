"""The PNG: throughput, ITL and TTFT per Poisson rate, and the latency the split adds per concurrency."""

from __future__ import annotations

from pathlib import Path

import _common as common

from .settings import SYSTEMS, TARGET_ITL_ADDED_MS


def plot(results: dict, rates: list[str], conc: list[str], verdict: dict, path: Path) -> None:
    plt = common.pyplot()
    x = list(range(len(rates)))
    style = {"served": ("#4c72b0", "served (HTTP, gRPC)"), "inprocess": ("#55a868", "in-process Engine")}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax, ax2), (ax3, ax4) = axes
    for name in SYSTEMS:
        col, lab = style[name]
        s = [results[name]["rates"][r]["summary"] for r in rates]
        ax.plot(x, [v["output_tok_s"] for v in s], "o-", color=col, label=lab)
        ax2.plot(x, [v["itl_ms_p50"] for v in s], "o-", color=col, label=f"{lab} p50")
        ax2.plot(x, [v["itl_ms_p99"] for v in s], "s--", color=col, alpha=0.7, label=f"{lab} p99")
        ax3.plot(x, [v["ttft_ms_p50"] for v in s], "o-", color=col, label=f"{lab} p50")
        ax3.plot(x, [v["ttft_ms_p99"] for v in s], "s--", color=col, alpha=0.7, label=f"{lab} p99")
    for i, r in enumerate(rates):
        s, p = results["served"]["rates"][r]["summary"], results["inprocess"]["rates"][r]["summary"]
        ax.annotate(
            f"{s['output_tok_s'] / p['output_tok_s']:.2f}x",
            (i, max(s["output_tok_s"], p["output_tok_s"])),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    for a, title, ylab in (
        (ax, "Output throughput (annotated: served / in-process)", "output tokens / s"),
        (ax2, "Inter-token latency", "ms per token"),
        (ax3, "Time to first token", "ms"),
    ):
        a.set_xticks(x, rates)
        a.set_xlabel("request rate (req/s; inf = all at t=0)")
        a.set_ylabel(ylab)
        a.set_title(title, fontsize=10)
        a.legend(fontsize=7)
        a.set_ylim(bottom=0)
    ax3.set_yscale("symlog", linthresh=10)
    xc = list(range(len(conc)))
    for metric, mark, col in (("tpot", "o-", "#c44e52"), ("itl", "s--", "#8172b2")):
        ys = [verdict["per_concurrency"][c][f"{metric}_ms_p50_added"] for c in conc]
        ax4.plot(xc, ys, mark, color=col, label=f"{metric.upper()} p50 added (median of repeats)")
        for i, c in enumerate(conc):  # each repeat's paired difference
            each = [r[f"{metric}_ms_p50_added"] for r in verdict["per_concurrency"][c]["repeats"]]
            ax4.plot([i] * len(each), each, ".", color=col, alpha=0.4)
        for i, y in zip(xc, ys, strict=True):
            ax4.annotate(
                f"{y:+.1f}", (i, y), textcoords="offset points", xytext=(6, 2), fontsize=7, color=col
            )
    ax4.axhline(TARGET_ITL_ADDED_MS, color="k", ls=":", lw=1, label=f"target {TARGET_ITL_ADDED_MS:g} ms")
    ax4.axhline(0, color="grey", lw=0.6)
    ax4.set_xticks(xc, conc)
    ax4.set_xlabel("closed loop: concurrent clients C")
    ax4.set_ylabel("served - in-process, paired per repeat (ms per token)")
    ax4.set_title("Latency added by the split (closed loop, batch ~C)", fontsize=10)
    ax4.legend(fontsize=7)
    common.save_figure(fig, path)
