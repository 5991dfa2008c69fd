"""Metrics and verdicts: per-token ITL, one system's summary of a run, the median over repeats,
and the served - in-process comparison against the targets."""

from __future__ import annotations

import statistics
from typing import Any

import _common as common

from .settings import SYSTEMS, TARGET_ITL_ADDED_MS, TARGET_THROUGHPUT_RATIO


def itl_samples(times: list[float], tokens: list[int]) -> list[float]:
    """Per-token ITL from (arrival time, tokens carried) events; the first event is the TTFT."""
    out: list[float] = []
    for i in range(1, len(times)):
        k = max(1, tokens[i])
        out += [(times[i] - times[i - 1]) / k] * k
    return out


def summarize(records: list[dict], wall_s: float) -> dict:
    """Aggregate one system's per-request records at one rate (seconds in, ms out)."""
    ok = [r for r in records if r["ok"]]
    itl = [x for r in ok for x in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    out_tokens = sum(r["output_tokens"] for r in records)
    makespan = max((r["e2e"] + r["arrival"] for r in ok), default=wall_s)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "output_tok_s": out_tokens / makespan,
        "request_s": len(ok) / makespan,
        **common.ms_percentiles("ttft", ttft),
        **common.ms_percentiles("itl", itl),
        "itl_ms_mean": 1e3 * sum(itl) / len(itl) if itl else float("nan"),
        **common.ms_percentiles("tpot", tpot),
        **common.ms_percentiles("e2e", e2e),
        "mean_in_flight": sum(e2e) / makespan,  # Little's law: requests in flight, time-averaged
        "all_exact": common.all_exact(records),
    }


def public_record(rec: dict) -> dict:
    """A request record for the JSON: no per-token lists."""
    keep = ("arrival", "prompt_tokens", "expected_tokens", "output_tokens", "ok", "ttft", "e2e")
    out = {k: rec[k] for k in keep}
    out.update({k: rec[k] for k in ("client", "chunks", "finish_reason", "error") if k in rec})
    return out


def meter_record(m: common.Meter) -> dict:
    return {"bench_process_cpu_s": m.cpu_s, "loadavg_1m_before_after": m.loadavg_before_after()}


def median_summary(summaries: list[dict]) -> dict:
    """Per measure, the median over repeats; counts are summed, ``all_exact`` must hold in all."""
    out: dict[str, Any] = {}
    for k, v in summaries[0].items():
        vals = [s[k] for s in summaries]
        if k in ("completed", "failed", "output_tokens"):
            out[k] = sum(vals)
        elif k == "all_exact":
            out[k] = all(vals)
        elif isinstance(v, bool) or not isinstance(v, int | float):
            out[k] = vals
        else:
            out[k] = statistics.median(vals)
    return out


def _added(s: dict, i: dict) -> dict:
    return {
        "output_tok_s_ratio": s["output_tok_s"] / i["output_tok_s"],
        "request_s_ratio": s["request_s"] / i["request_s"],
        "itl_ms_p50_added": s["itl_ms_p50"] - i["itl_ms_p50"],
        "itl_ms_p99_added": s["itl_ms_p99"] - i["itl_ms_p99"],
        "ttft_ms_p50_added": s["ttft_ms_p50"] - i["ttft_ms_p50"],
        "tpot_ms_p50_added": s["tpot_ms_p50"] - i["tpot_ms_p50"],
    }


def compare(results: dict, rates: list[str], conc: list[str]) -> dict:
    """Throughput target on the saturated Poisson rate; the ITL target on the closed-loop runs,
    where both systems hold the same batch (~C) at every step, so the difference is the split's
    per-step cost (under Poisson load past saturation the batch composition drifts between the
    two, and so does ITL: those differences are reported, not judged)."""

    def pair(section: str, key: str) -> dict:
        return _added(
            results["served"][section][key]["summary"], results["inprocess"][section][key]["summary"]
        )

    def paired(c: str) -> dict:
        """Each repeat's served - in-process, then the median over repeats (paired: both systems ran
        the same draw back to back, so the machine's slow drifts cancel in the difference)."""
        runs = zip(
            results["served"]["concurrency"][c]["repeats"],
            results["inprocess"]["concurrency"][c]["repeats"],
            strict=True,
        )
        reps = [_added(s["summary"], i["summary"]) for s, i in runs]
        return {**{k: statistics.median(r[k] for r in reps) for k in reps[0]}, "repeats": reps}

    per_rate = {r: pair("rates", r) for r in rates}
    per_conc = {c: paired(c) for c in conc}
    sat = "inf" if "inf" in rates else max(rates, key=float)
    worst_tpot = max(v["tpot_ms_p50_added"] for v in per_conc.values())
    worst_itl = max(v["itl_ms_p50_added"] for v in per_conc.values())
    exact = all(
        results[sys_][section][key]["summary"]["all_exact"]
        for sys_ in SYSTEMS
        for section, keys in (("rates", rates), ("concurrency", conc))
        for key in keys
    )
    return {
        "per_rate": per_rate,
        "per_concurrency": per_conc,
        "saturation_rate": sat,
        "throughput_ratio_at_saturation": per_rate[sat]["output_tok_s_ratio"],
        f"served_ge_{TARGET_THROUGHPUT_RATIO:g}x_inprocess_at_saturation": per_rate[sat]["output_tok_s_ratio"]
        >= TARGET_THROUGHPUT_RATIO,
        "closed_loop_max_tpot_ms_p50_added": worst_tpot,
        "closed_loop_max_itl_ms_p50_added": worst_itl,
        # the target: median inter-token latency (per token gap, as vLLM's ITL)
        f"closed_loop_itl_p50_added_le_{TARGET_ITL_ADDED_MS:g}ms": worst_itl <= TARGET_ITL_ADDED_MS,
        # reported beside it: the median request's time per output token, which also carries the
        # later join of a closed-loop client's next request (its HTTP round trip)
        f"closed_loop_tpot_p50_added_le_{TARGET_ITL_ADDED_MS:g}ms": worst_tpot <= TARGET_ITL_ADDED_MS,
        "poisson_max_itl_ms_p50_added": max(v["itl_ms_p50_added"] for v in per_rate.values()),
        "every_request_exact": exact,
    }
