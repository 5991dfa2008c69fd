"""The console report: the Poisson and closed-loop tables and the targets' verdicts."""

from __future__ import annotations

from collections.abc import Iterator

from .settings import SYSTEMS, TARGET_ITL_ADDED_MS, TARGET_THROUGHPUT_RATIO


def _table_rows(
    results: dict, verdict: dict, section: str, per: str, keys: list[str]
) -> Iterator[tuple[str, str, dict, dict | None]]:
    """``(key, system, summary, comparison)`` per row; the comparison (served - in-process, from
    ``verdict[per]``) only on the served row."""
    for key in keys:
        for name in SYSTEMS:
            v = verdict[per][key] if name == "served" else None
            yield key, name, results[name][section][key]["summary"], v


def _served_cell(v: dict | None, key: str, spec: str, width: int, suffix: str = "") -> str:
    """A comparison value on the served row; blanks of the column's width on the in-process row."""
    return f"{v[key]:{spec}}{suffix}" if v is not None else " " * width


def format_table(results: dict, rates: list[str], conc: list[str], verdict: dict) -> str:
    head = (
        f"{'rate':>5} {'system':9} {'ok':>5} {'out_tok/s':>9} {'req/s':>6} {'ratio':>6} {'TTFT50':>7}"
        f" {'TTFT99':>7} {'ITL50':>6} {'ITL99':>6} {'+ITL50':>6} {'TPOT50':>6} {'e2e50':>7} {'e2e99':>7}"
    )
    lines = ["Poisson arrivals", head, "-" * len(head)]
    for r, name, s, v in _table_rows(results, verdict, "rates", "per_rate", rates):
        ratio = _served_cell(v, "output_tok_s_ratio", ">5.2f", 6, "x")
        added = _served_cell(v, "itl_ms_p50_added", ">+6.2f", 6)
        lines.append(
            f"{r:>5} {name:9} {s['completed']:>2}/{s['completed'] + s['failed']:<2}"
            f" {s['output_tok_s']:>9.1f} {s['request_s']:>6.2f} {ratio}"
            f" {s['ttft_ms_p50']:>7.0f} {s['ttft_ms_p99']:>7.0f}"
            f" {s['itl_ms_p50']:>6.1f} {s['itl_ms_p99']:>6.1f} {added} {s['tpot_ms_p50']:>6.1f}"
            f" {s['e2e_ms_p50']:>7.0f} {s['e2e_ms_p99']:>7.0f}"
        )
    head = (
        f"{'C':>5} {'system':9} {'ok':>7} {'out_tok/s':>9} {'ratio':>6} {'inflt':>5} {'TTFT50':>7}"
        f" {'ITL50':>6} {'ITL99':>6} {'+ITL50':>6} {'TPOT50':>6} {'+TPOT50':>7} {'e2e50':>7}"
    )
    lines += [
        "",
        "Closed loop (C clients, requests back to back; medians over repeats, +X: median of paired"
        " differences)",
        head,
        "-" * len(head),
    ]
    for c, name, s, v in _table_rows(results, verdict, "concurrency", "per_concurrency", conc):
        ratio = _served_cell(v, "output_tok_s_ratio", ">5.2f", 6, "x")
        itl = _served_cell(v, "itl_ms_p50_added", ">+6.2f", 6)
        tpot = _served_cell(v, "tpot_ms_p50_added", ">+7.2f", 7)
        lines.append(
            f"{c:>5} {name:9} {s['completed']:>3}/{s['completed'] + s['failed']:<3}"
            f" {s['output_tok_s']:>9.1f} {ratio} {s['mean_in_flight']:>5.1f} {s['ttft_ms_p50']:>7.1f}"
            f" {s['itl_ms_p50']:>6.1f} {s['itl_ms_p99']:>6.1f} {itl} {s['tpot_ms_p50']:>6.1f} {tpot}"
            f" {s['e2e_ms_p50']:>7.0f}"
        )
    lines.append(
        "(times in ms; ratio = served / in-process output tok/s; +X = served - in-process;"
        " inflt = mean requests in flight)"
    )
    sat = verdict["saturation_rate"]
    ok_t = verdict[f"served_ge_{TARGET_THROUGHPUT_RATIO:g}x_inprocess_at_saturation"]
    ok_i = verdict[f"closed_loop_itl_p50_added_le_{TARGET_ITL_ADDED_MS:g}ms"]
    ok_p = verdict[f"closed_loop_tpot_p50_added_le_{TARGET_ITL_ADDED_MS:g}ms"]
    lines.append(
        f"target served >= {TARGET_THROUGHPUT_RATIO:g}x in-process at saturation (Poisson rate {sat}):"
        f" {verdict['throughput_ratio_at_saturation']:.2f}x -> {'PASS' if ok_t else 'FAIL'}"
    )
    lines.append(
        f"target median ITL added <= {TARGET_ITL_ADDED_MS:g} ms (closed loop, every concurrency): worst"
        f" +ITL50 {verdict['closed_loop_max_itl_ms_p50_added']:+.2f} ms -> {'PASS' if ok_i else 'FAIL'}"
        f" (reported, per request: worst +TPOT50 {verdict['closed_loop_max_tpot_ms_p50_added']:+.2f} ms"
        f" -> {'within' if ok_p else 'over'} {TARGET_ITL_ADDED_MS:g} ms)"
    )
    lines.append(
        f"(Poisson, not judged: worst +ITL50 {verdict['poisson_max_itl_ms_p50_added']:+.2f} ms;"
        " past saturation the batch composition drifts between the systems)"
    )
    exact = verdict["every_request_exact"]
    lines.append(f"every request exact (finish 'length', right token count): {exact}")
    return "\n".join(lines)
