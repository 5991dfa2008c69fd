"""policy_sim.png: hit rate against p99 wait per workload, and poisson's hit rate against p."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import _common as common

from .cost_model import BANNER

FAIR_COLORS = ["#d9b3ff", "#b366ff", "#7a1fd1", "#3d0073"]  # light -> dark: shorter -> longer timeout
POLICY_STYLE = {"fcfs": ("tab:red", "s"), "lpm": ("tab:blue", "o"), "dfs-weight": ("tab:green", "^")}


def plot(results: list[dict], path: Path) -> None:
    plt = common.pyplot()
    poisson_ps = sorted({r["p"] for r in results if r["workload"] == "poisson"})
    panels = [("burst32", None), *(("poisson", p) for p in poisson_ps)]
    ncols = 3
    nrows = math.ceil((len(panels) + 1) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax, (wl, p) in zip(axes.flat, panels, strict=False):
        rs = [r for r in results if r["workload"] == wl and r["p"] == p]
        _hit_rate_vs_wait(ax, rs, wl if p is None else f"poisson p={p}")
    rest = list(axes.flat)[len(panels) :]
    if rest and any(r["workload"] == "poisson" for r in results):
        _poisson_hit_rate_vs_p(rest[0], [r for r in results if r["workload"] == "poisson"])
        rest = rest[1:]
    for ax in rest:
        ax.axis("off")
    fig.suptitle("radixserve schedule policies: " + BANNER, fontsize=9)
    common.save_figure(fig, path)


def _hit_rate_vs_wait(ax: Any, rs: list[dict], title: str) -> None:
    """One workload: each setting's hit rate and p99 wait, and the hit-rate ceiling."""
    import matplotlib.ticker

    timeouts = sorted({r["fairness_timeout"] for r in rs if r["fairness_timeout"] is not None})
    # Draw large markers first so coinciding results stay visible as concentric rings.
    for k, r in enumerate(rs):
        if r["fairness_timeout"] is not None:
            c, mk = FAIR_COLORS[timeouts.index(r["fairness_timeout"]) % len(FAIR_COLORS)], "D"
        else:
            c, mk = POLICY_STYLE[r["policy"]]
        ax.scatter(
            100 * r["hit_rate"],
            r["wait_p99_s"],
            s=150 - 15 * k,
            marker=mk,
            facecolors="none",
            edgecolors=c,
            linewidths=1.6,
            zorder=3,
            label=f"{r['label']}: {100 * r['hit_rate']:.1f}%, {r['wait_p99_s']:.2f}s",
        )
    if rs:
        ax.axvline(100 * rs[0]["hit_rate_optimum"], color="grey", ls="--", lw=0.8, label="hit-rate ceiling")
    ax.legend(fontsize=6.5, loc="best", framealpha=0.8, markerscale=0.6)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.margins(x=0.15, y=0.15)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("prefix-cache hit rate (%)  [dashed: ceiling]")
    ax.set_ylabel("p99 queue wait (virtual s, log)")
    ax.grid(alpha=0.3)


def _poisson_hit_rate_vs_p(ax: Any, poisson: list[dict]) -> None:
    """Each setting's hit rate across the poisson streams' shared-prefix rates, and the ceiling."""
    for lab in dict.fromkeys(r["label"] for r in poisson):
        rs = sorted((r for r in poisson if r["label"] == lab), key=lambda r: r["p"])
        ax.plot([r["p"] for r in rs], [100 * r["hit_rate"] for r in rs], marker="o", ms=3, lw=1, label=lab)
    rs = sorted((r for r in poisson if r["label"] == "fcfs"), key=lambda r: r["p"])
    ax.plot([r["p"] for r in rs], [100 * r["hit_rate_optimum"] for r in rs], "k--", lw=0.8, label="ceiling")
    ax.set_title("poisson: hit rate vs shared-prefix rate p", fontsize=10)
    ax.set_xlabel("p")
    ax.set_ylabel("hit rate (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
