"""What the repeats add up to: each system's median repeat, the verdict on the paired ratios, and the
console summary."""

from __future__ import annotations

import json
import statistics

TARGET_SPEEDUP = 3.0  # the issue: ours >= 3x HF's output throughput; overlap never slower than normal
SYSTEMS = ("hf", "ours_normal", "ours_overlap")


def median_runs(repeats: list[dict[str, dict]]) -> dict[str, dict]:
    """Per system, the repeat with the median output tok/s (a real run, whole), with every repeat's
    tok/s alongside (``repeats_output_tok_s``); its ``speedup_vs_hf`` is the median of the repeats'."""
    out = {}
    for name in SYSTEMS:
        tps = [r[name]["output_tok_s"] for r in repeats]
        mid = sorted(range(len(tps)), key=tps.__getitem__)[(len(tps) - 1) // 2]
        out[name] = {
            **repeats[mid][name],
            "repeats_output_tok_s": tps,
            "speedup_vs_hf": statistics.median(r[name]["speedup_vs_hf"] for r in repeats),
        }
    return out


def verdict(repeats: list[dict[str, dict]]) -> dict:
    """Ratios within each repeat (paired), judged on their median; every repeat's are listed."""

    def ratios(a: str, b: str) -> list[float]:
        return [r[a]["output_tok_s"] / r[b]["output_tok_s"] for r in repeats]

    normal, overlap = ratios("ours_normal", "hf"), ratios("ours_overlap", "hf")
    ov = ratios("ours_overlap", "ours_normal")
    best = statistics.median(max(a, b) for a, b in zip(normal, overlap, strict=True))
    return {
        "repeats": len(repeats),
        "speedup_normal_vs_hf": statistics.median(normal),
        "speedup_overlap_vs_hf": statistics.median(overlap),
        "overlap_vs_normal": statistics.median(ov),
        "speedup_normal_vs_hf_each": normal,
        "speedup_overlap_vs_hf_each": overlap,
        "overlap_vs_normal_each": ov,
        f"ours_ge_{TARGET_SPEEDUP:g}x_hf": best >= TARGET_SPEEDUP,
        f"ours_ge_{TARGET_SPEEDUP:g}x_hf_in_every_repeat": all(
            max(a, b) >= TARGET_SPEEDUP for a, b in zip(normal, overlap, strict=True)
        ),
        "overlap_not_slower_than_normal": statistics.median(ov) >= 1.0,
        "overlap_not_slower_in_every_repeat": min(ov) >= 1.0,
    }


def format_table(results: dict) -> str:
    hf = results["hf"]
    head = (
        f"{'system':13} {'wall_s':>7} {'out_tok/s':>9} {'tot_tok/s':>9} {'vs_hf':>6} {'steps':>6}"
        f" {'host_ms/st':>10} {'p50':>6} {'p99':>6} {'host%':>6} {'cpu/wall':>8}"
    )
    lines = [head, "-" * len(head)]
    for name in SYSTEMS:
        r = results[name]
        ratio = r["speedup_vs_hf"]
        if name == "hf":
            extra = f" {'':>6} {'':>10} {'':>6} {'':>6} {'':>6}"
        else:
            extra = (
                f" {r['steps']:>6} {r['host_ms_per_step']:>10.2f} {r['host_ms_p50']:>6.2f}"
                f" {r['host_ms_p99']:>6.2f} {100 * r['host_frac_of_wall']:>5.1f}%"
            )
        lines.append(
            f"{name:13} {r['wall_s']:>7.1f} {r['output_tok_s']:>9.1f} {r['total_tok_s']:>9.1f}"
            f" {ratio:>5.2f}x{extra} {r['cpu_per_wall']:>8.2f}"
        )
    lines.append(
        f"hf: B={hf['batch_size']}, raw generated {hf['raw_generated_tokens']} tokens"
        f" ({hf['raw_generated_tok_s']:.1f} tok/s) for {hf['output_tokens']} useful"
    )
    lines.append(
        "rows: each system's median repeat; vs_hf: median of the repeats' paired ratios; out tok/s per"
        " repeat: "
        + ", ".join(
            f"{n} " + "/".join(f"{v:.0f}" for v in results[n]["repeats_output_tok_s"]) for n in SYSTEMS
        )
    )
    return "\n".join(lines)


def print_summary(report: dict) -> None:
    """The table, the verdict, the host-bound ratios and the correctness check, on the console."""
    print(format_table(report["results"]))
    print("verdict:", json.dumps(report["verdict"]))
    if "host_bound" in report:
        hb = report["host_bound"]
        print(
            "host-bound (tiny model): overlap / normal "
            + ", ".join(f"{x:.3f}" for x in hb["overlap_vs_normal_each"])
            + "; all threaded / normal "
            + ", ".join(f"{x:.3f}" for x in hb["overlap_thread_vs_normal_each"])
        )
    print("correctness vs HF batch-1:", json.dumps(report["correctness_vs_hf_batch1"]))
