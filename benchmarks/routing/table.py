"""The console report: one table per offered rate, then the rates where each target was met."""

from __future__ import annotations

from .settings import (
    TARGET_DECISION_P99_MS,
    TARGET_HIT_RATIO,
    TARGET_THROUGHPUT_RATIO,
    TARGET_TTFT_P90_DIVISOR,
)


def format_table(results: dict, verdict: dict) -> str:
    head = (
        f"{'config':18} {'ok':>9} {'hit':>6} {'hit x':>6} {'out tok/s':>9} {'req/s':>6} {'thr x':>6}"
        f" {'TTFT50':>7} {'TTFT90':>7} {'TTFT99':>7} {'/p90':>6} {'e2e50':>7} {'dec50':>6} {'dec99':>6}"
        f" {'per pod':>17} {'prefills':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, res in results.items():
        s, d, r = res["summary"], res["decision"], res["routing"]
        v = verdict["vs_round_robin"][name]
        pods = "/".join(map(str, r["requests_per_pod"]))
        lines.append(
            f"{name:18} {s['completed']:>4}/{s['completed'] + s['failed']:<4} {s['hit_rate']:>6.3f}"
            f" {v['hit_rate_x']:>5.2f}x {s['output_tok_s']:>9.1f} {s['request_s']:>6.2f}"
            f" {v['output_tok_s_x']:>5.2f}x"
            f" {s['ttft_ms_p50']:>7.0f} {s['ttft_ms_p90']:>7.0f} {s['ttft_ms_p99']:>7.0f}"
            f" {v['ttft_p90_divisor']:>5.1f}x {s['e2e_ms_p50']:>7.0f}"
            f" {d['decision_ms_p50']:>6.3f} {d['decision_ms_p99']:>6.3f} {pods:>17} {r['prefix_prefills']:>8}"
        )
    lines.append(
        "(times in ms; hit = cached / prompt tokens; x and /p90 vs round-robin; dec = routing decision,"
        " in-process replay; per pod = requests served by each pod; prefills = tenant prefixes"
        " (re)computed on some pod)"
    )
    for name, t in verdict["targets"].items():
        v, d = verdict["vs_round_robin"][name], results[name]["decision"]
        got = {
            f"hit_rate_ge_{TARGET_HIT_RATIO:g}x": f"{v['hit_rate_x']:.2f}x",
            f"throughput_ge_{TARGET_THROUGHPUT_RATIO:g}x": (
                f"{v['output_tok_s_x_median']:.2f}x (median of the paired repeats)"
                if "output_tok_s_x_median" in v
                else f"{v['output_tok_s_x']:.2f}x"
            ),
            f"ttft_p90_ge_{TARGET_TTFT_P90_DIVISOR:g}x_lower": f"{v['ttft_p90_divisor']:.1f}x",
            f"decision_p99_lt_{TARGET_DECISION_P99_MS:g}ms": f"{d['decision_ms_p99']:.3f} ms",
        }
        for key, ok in t.items():
            lines.append(f"target {name}: {key}: {got[key]} -> {'PASS' if ok else 'FAIL'}")
    lines.append(
        f"every request exact (finish 'length', right token count): {verdict['every_request_exact']}"
    )
    return "\n".join(lines)


def print_report(report: dict) -> None:
    """Every rate's table, then per cache-aware configuration the rates where each target was met."""
    for r in report["runs"]:
        print(f"\noffered load {r['rate']} req/s")
        print(format_table(r["results"], r["verdict"]))
    print()
    for name, t in report["targets"].items():
        for key, rates in t["met_at_rates"].items():
            print(f"{name}: {key}: met at rates {rates or 'none'}")
        x, each = t["throughput_x_at_highest_rate"], t["throughput_x_at_highest_rate_each"]
        print(
            f"{name}: throughput x at the highest rate ({t['highest_rate']}): {x:.2f}x"
            f" (median of {len(each)} paired repeats: {', '.join(f'{e:.2f}' for e in each)})"
        )
