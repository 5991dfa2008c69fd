"""The console table: one row per (workload, policy) setting, grouped by workload."""

from __future__ import annotations

from .cost_model import BANNER

# (header, width, format, value) per column; a None value prints "-".
COLUMNS = [
    ("hit%", 6, ".1f", lambda r: 100 * r["hit_rate"]),
    (
        "shrd%",
        6,
        ".1f",
        lambda r: 100 * r["shared_prefix_hit_rate"] if "shared_prefix_hit_rate" in r else None,
    ),
    ("p50 w", 7, ".2f", lambda r: r["wait_p50_s"]),
    ("p99 w", 7, ".2f", lambda r: r["wait_p99_s"]),
    ("max w", 7, ".2f", lambda r: r["wait_max_s"]),
    ("overdue", 7, ".2f", lambda r: r.get("max_overdue_s")),
    ("ov/stp", 6, ".1f", lambda r: r.get("max_overdue_mean_steps")),
    ("ovtk", 4, "d", lambda r: r.get("overtaken_while_overdue")),
    ("hol", 5, ".2f", lambda r: r.get("max_hol_overdue_s")),
    ("hol/s", 5, ".1f", lambda r: r.get("max_hol_overdue_mean_steps")),
    ("stp ms", 6, ".1f", lambda r: 1000 * r["mean_step_s"]),
    ("maxstp", 6, ".0f", lambda r: 1000 * r["max_step_s"]),
    ("tok/s", 7, ".0f", lambda r: r["throughput_tok_s"]),
    ("time s", 7, ".1f", lambda r: r["makespan_s"]),
    ("steps", 6, "d", lambda r: r["steps"]),
    ("retr", 5, "d", lambda r: r["retractions"]),
    ("q.avg", 5, ".1f", lambda r: r["mean_waiting_reqs"]),
]
HEADER = f"{'policy':<18}" + "".join(f" {h:>{w}}" for h, w, _, _ in COLUMNS)


def _fmt_row(r: dict) -> str:
    cells = []
    for _, w, fmt, get in COLUMNS:
        v = get(r)
        cells.append(f" {'-':>{w}}" if v is None else f" {v:>{w}{fmt}}")
    return f"{r['label']:<18}" + "".join(cells)


def print_table(results: list[dict]) -> None:
    print(BANNER)
    print(
        "hit% = cached/prompt tokens at first admission; shrd% = hits on the shared system prompt;"
        " w = queue wait (admit - arrival), virtual s\n"
        "overdue = max over requests of max(0, wait - fairness_timeout); ov/stp = overdue / mean step;"
        " ovtk = (older, younger) pairs where the younger was admitted while the older was overdue;\n"
        "hol = max delay from 'overdue AND all older requests admitted' to admission; hol/s: in mean steps\n"
        "stp ms / maxstp = mean / max step time (ms); q.avg = time-averaged waiting requests"
    )
    key = None
    for r in results:
        k = (r["workload"], r["p"])
        if k != key:
            key = k
            if r["workload"] == "burst32":
                title = f"\n== burst32  (hit% ceiling {100 * r['hit_rate_optimum']:.1f}"
                title += f", shared-prefix ceiling {100 * r['shared_prefix_hit_rate_optimum']:.1f})"
            else:
                title = (
                    f"\n== poisson p={r['p']}  ({r['num_requests']} req, nominal {r['nominal_rate']:g} req/s"
                    f" (measured {r['arrival_rate']:.2f}),"
                    f" hit% ceiling {100 * r['hit_rate_optimum']:.1f})"
                )
            print(title)
            print(HEADER)
        print(_fmt_row(r))
