"""Online serving: the HTTP server (``radixserve serve``) vs the same Engine in-process, Poisson arrivals.

One seeded workload per request rate, two systems, same model, same engine arguments, same machine:

* ``served``: ``launcher.build_cluster`` (gateway + 1 scheduler process + detokenizer, gRPC between
  them, the scheduler with ``--threads`` torch threads); every request is streamed from this process
  over HTTP (``httpx.AsyncClient``, ``POST /v1/completions``, ``stream: true``,
  ``stream_options.include_usage``), prompt sent as token ids, ``max_tokens`` = output length.
* ``inprocess``: ``Engine(model, **same engine args)`` in this process (``torch.set_num_threads``),
  driven by a loop that adds each ``Req`` at its arrival time and calls ``engine.loop.step()``; after
  each step, a request whose known output length grew got those tokens at that moment.

Workload: for each rate (``--rates``, req/s; ``inf`` = every request at t=0, i.e. saturation), ``N``
requests with exponential inter-arrival gaps (Poisson process, first request at t=0); random prompt
token ids (special ids 0..4 avoided, a fresh draw per rate so nothing hits the radix cache), input
and output lengths uniform in ``--input-range`` / ``--output-range``; greedy, ``ignore_eos``, so
every request produces exactly its output length (checked). Served requests also set
``skip_special_tokens: false`` so a sampled special token still produces a text chunk.

Per request (times from the request's arrival: the scheduled time in-process, the moment the HTTP
request is started for served, which is the scheduled time up to event-loop lag):

* TTFT: time to the first non-empty text chunk (served) / the step that produced the first token.
* ITL, per token: a chunk (or engine step) that delivers ``k`` tokens ``g`` seconds after the
  previous one contributes ``k`` samples of ``g / k``. In-process ``k`` is exact (normal loop: 1).
  The SSE chunks carry text, not token counts: when a request's content-chunk count equals
  ``usage.completion_tokens`` every chunk is one token and the samples are exact; otherwise (the
  detokenizer held back a partial UTF-8 character, so some chunk carried 2+ tokens and the stream
  does not say which) each of that request's gaps is divided by its mean tokens per gap
  ``(N - 1) / (chunks - 1)``; such requests are counted (``requests_multi_token_chunks``).
* TPOT = (e2e - TTFT) / (N - 1), exact for both; e2e = time to the last token / ``[DONE]``.

Per rate and system: TTFT / ITL / TPOT / e2e p50 and p99, output tok/s and req/s over the makespan
(first arrival to last completion); served / in-process throughput ratio and the served - in-process
median ITL (ms). Targets (measured, never asserted): at saturation (rate ``inf``, else the highest
rate) served output throughput >= 0.9x in-process; median ITL added by the served path <= 2 ms at
every rate.

    .venv/bin/python benchmarks/serving.py [--quick] [--out DIR] [--rates 1 2 4 inf] ...
    radixserve bench serving [same flags]

Writes DIR/serving.json and DIR/serving.png.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_machine.py
from _machine import machine_info

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SPECIAL_IDS = 5  # ids 0..4 are the demo tokenizer's special tokens
TARGET_THROUGHPUT_RATIO = 0.9  # served output tok/s at saturation >= 0.9x in-process
TARGET_ITL_ADDED_MS = 2.0  # served median ITL - in-process median ITL <= 2 ms
SYSTEMS = ("served", "inprocess")
MODEL_NAME = "bench"

FULL = dict(
    model_size="small",
    num_requests=48,
    rates=("1", "2", "4", "inf"),
    input_range=(64, 256),
    output_range=(32, 128),
    max_running_requests=128,
)
QUICK = dict(
    model_size="tiny",
    num_requests=8,
    rates=("4", "inf"),
    input_range=(16, 48),
    output_range=(4, 16),
    max_running_requests=16,
)


# --------------------------------------------------------------------------- workload
def parse_rate(s: str) -> float:
    r = float(s)  # "inf" parses
    if not r > 0:
        raise ValueError(f"a rate must be > 0 (or inf), got {s!r}")
    return r


def rate_label(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:g}"


def build_workload(
    num_requests: int,
    rate: float,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[dict]:
    """Seeded requests sorted by arrival: ``arrival`` (s from the start), ``input_ids``, ``output_len``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = np.zeros(num_requests) if math.isinf(rate) else rng.exponential(1.0 / rate, num_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if num_requests else np.zeros(0)
    reqs = []
    for t in arrivals:
        n_in = int(rng.integers(input_range[0], input_range[1] + 1))
        n_out = int(rng.integers(output_range[0], output_range[1] + 1))
        ids = rng.integers(SPECIAL_IDS, vocab_size, n_in).tolist()
        reqs.append({"arrival": float(t), "input_ids": ids, "output_len": n_out})
    return reqs


def rate_seed(seed: int, k: int) -> int:
    return seed * 1000 + k  # a fresh prompt set per rate: no radix-cache hits across rates


def workload_summary(reqs: list[dict]) -> dict:
    ins = [len(r["input_ids"]) for r in reqs]
    outs = [r["output_len"] for r in reqs]
    return {
        "num_requests": len(reqs),
        "prompt_tokens": sum(ins),
        "output_tokens": sum(outs),
        "input_len_mean": sum(ins) / len(ins),
        "output_len_mean": sum(outs) / len(outs),
        "last_arrival_s": reqs[-1]["arrival"],
    }


def engine_args(workloads: list[list[dict]], max_running_requests: int, page_size: int = 16) -> dict:
    """One rate's requests all fit at once (no retraction); earlier rates' cached prompts get evicted."""
    need = max(sum(len(r["input_ids"]) + r["output_len"] + page_size for r in w) for w in workloads)
    return dict(
        page_size=page_size,
        max_total_tokens=need + 64 * page_size,
        max_running_requests=max_running_requests,
    )


def scheduler_flags(eargs: dict) -> list[str]:
    out: list[str] = []
    for k, v in eargs.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


# ------------------------------------------------------------------------------- stats
def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


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
    ms = 1e3
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "output_tok_s": out_tokens / makespan,
        "request_s": len(ok) / makespan,
        "ttft_ms_p50": ms * _pct(ttft, 50),
        "ttft_ms_p99": ms * _pct(ttft, 99),
        "itl_ms_p50": ms * _pct(itl, 50),
        "itl_ms_p99": ms * _pct(itl, 99),
        "itl_ms_mean": ms * sum(itl) / len(itl) if itl else float("nan"),
        "tpot_ms_p50": ms * _pct(tpot, 50),
        "tpot_ms_p99": ms * _pct(tpot, 99),
        "e2e_ms_p50": ms * _pct(e2e, 50),
        "e2e_ms_p99": ms * _pct(e2e, 99),
        "all_exact": all(r["ok"] and r["output_tokens"] == r["expected_tokens"] for r in records),
    }


def _public(rec: dict) -> dict:
    """A request record for the JSON: no per-token lists."""
    keep = ("arrival", "prompt_tokens", "expected_tokens", "output_tokens", "ok", "ttft", "e2e")
    out = {k: rec[k] for k in keep}
    out.update({k: rec[k] for k in ("chunks", "finish_reason", "error") if k in rec})
    return out


def _finite(obj: Any) -> Any:
    """NaN (a statistic of no samples) as null: the JSON stays strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


class CpuMeter:
    def __enter__(self) -> CpuMeter:
        self.load0 = os.getloadavg()[0]
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.cpu_s = time.process_time() - self.cpu0
        self.load1 = os.getloadavg()[0]

    def record(self) -> dict:
        return {
            "bench_process_cpu_s": self.cpu_s,
            "loadavg_1m_before_after": [round(self.load0, 2), round(self.load1, 2)],
        }


# ------------------------------------------------------------------------------ served
async def _stream_one(client: Any, url: str, req: dict, start: float) -> dict:
    rec: dict[str, Any] = {
        "arrival": req["arrival"],
        "prompt_tokens": len(req["input_ids"]),
        "expected_tokens": req["output_len"],
        "output_tokens": 0,
        "ok": False,
        "ttft": float("nan"),
        "e2e": float("nan"),
        "itl": [],
        "chunks": 0,
        "finish_reason": None,
        "error": None,
    }
    delay = start + req["arrival"] - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {
        "model": MODEL_NAME,
        "prompt": req["input_ids"],
        "max_tokens": req["output_len"],
        "temperature": 0.0,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    rec["arrival"] = t0 - start  # the actual send time (the schedule up to event-loop lag)
    times: list[float] = []
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                payload = line[6:]
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    rec["error"] = str(obj["error"])[:300]
                    break
                if obj.get("usage"):
                    usage = obj["usage"]
                for c in obj.get("choices") or ():
                    if c.get("text"):
                        times.append(now)
                    if c.get("finish_reason"):
                        rec["finish_reason"] = c["finish_reason"]
        end = time.perf_counter()
    except Exception as e:  # a transport error is a failed request, not a failed benchmark
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        return rec
    n = int(usage["completion_tokens"]) if usage else 0
    rec["output_tokens"] = n
    rec["chunks"] = len(times)
    if not times or rec["error"]:
        rec["error"] = rec["error"] or "no text chunk"
        return rec
    rec["ttft"] = times[0] - t0
    rec["e2e"] = end - t0
    c = len(times)
    if c == n or c < 2:
        rec["itl"] = itl_samples(times, [1] * c)
    else:  # some chunk carried 2+ tokens; the stream does not say which: spread them evenly
        mean_k = (n - 1) / (c - 1)
        rec["itl"] = [(times[i] - times[i - 1]) / mean_k for i in range(1, c)]
    rec["ok"] = rec["finish_reason"] == "length" and n == req["output_len"]
    if not rec["ok"] and rec["error"] is None:
        rec["error"] = f"finish_reason {rec['finish_reason']!r}, {n} tokens of {req['output_len']}"
    return rec


async def _run_rate_served(url: str, reqs: list[dict]) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter() + 0.05  # every task is created (and sleeping) before t=0
        tasks = [asyncio.create_task(_stream_one(client, url, r, start)) for r in reqs]
        records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return list(records), wall


async def _warm_served(url: str, vocab_size: int) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=120.0) as client:
        for i in range(2):
            ids = [SPECIAL_IDS + (7 * i + j) % (vocab_size - SPECIAL_IDS) for j in range(24)]
            await _stream_one(client, url, {"arrival": 0.0, "input_ids": ids, "output_len": 4}, 0.0)


def run_served(model_path: Path, workloads: list[list[dict]], eargs: dict, args: argparse.Namespace) -> dict:
    from radixserve.launcher import build_cluster, free_port

    cluster = build_cluster(
        Path(model_path),
        MODEL_NAME,
        port=free_port(),
        schedulers=1,
        scheduler_args=scheduler_flags(eargs),
        torch_threads=args.threads,
    )
    t = time.perf_counter()
    cluster.start()
    startup = time.perf_counter() - t
    out: dict[str, Any] = {"cluster_start_s": startup, "rates": {}}
    try:
        asyncio.run(_warm_served(cluster.url, args.vocab_size))
        for rate, reqs in zip(args.rates, workloads, strict=True):
            with CpuMeter() as m:
                records, wall = asyncio.run(_run_rate_served(cluster.url, reqs))
            dead = [s.name for s in cluster.services if not s.alive()]
            summary = {**summarize(records, wall), **m.record(), "dead_services": dead}
            summary["requests_multi_token_chunks"] = sum(
                r["ok"] and r["chunks"] != r["output_tokens"] for r in records
            )
            errors = sorted({r["error"] for r in records if r["error"]})
            summary["errors"] = errors[:5]
            out["rates"][rate_label(rate)] = {"summary": summary, "requests": [_public(r) for r in records]}
            _progress("served", rate, summary)
            if dead:
                raise RuntimeError(f"served: {dead} exited during rate {rate_label(rate)}")
    finally:
        cluster.stop()
    return out


# ---------------------------------------------------------------------------- in-process
def _warm_engine(engine: Any, vocab_size: int) -> None:
    from radixserve import SamplingParams

    ids = [[SPECIAL_IDS + (7 * i + j) % (vocab_size - SPECIAL_IDS) for j in range(24)] for i in range(2)]
    engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0))


def _run_rate_inprocess(engine: Any, reqs: list[dict], tag: str) -> tuple[list[dict], float]:
    from radixserve import SamplingParams
    from radixserve.scheduler.policy.req import Req

    loop, sched = engine.loop, engine.scheduler
    recs = [
        {
            "arrival": r["arrival"],
            "prompt_tokens": len(r["input_ids"]),
            "expected_tokens": r["output_len"],
            "output_tokens": 0,
            "ok": False,
            "ttft": float("nan"),
            "e2e": float("nan"),
            "times": [],
            "ks": [],
        }
        for r in reqs
    ]
    live: dict[str, tuple[Req, dict]] = {}
    done = 0
    nxt = 0
    start = time.perf_counter()
    while done < len(reqs):
        now = time.perf_counter() - start
        while nxt < len(reqs) and reqs[nxt]["arrival"] <= now:
            r = reqs[nxt]
            sp = SamplingParams(max_new_tokens=r["output_len"], temperature=0.0, ignore_eos=True)
            sp.validate()
            req = Req(f"{tag}-{nxt}", list(r["input_ids"]), sp)
            sched.add(req)
            live[req.rid] = (req, recs[nxt])
            nxt += 1
        if not loop.busy:
            if nxt < len(reqs):
                time.sleep(max(0.0, reqs[nxt]["arrival"] - (time.perf_counter() - start)))
            continue
        finished = loop.step()
        t = time.perf_counter() - start
        for req, rec in live.values():
            known = req.known_len - req.prompt_len
            if known > rec["output_tokens"]:
                rec["times"].append(t)
                rec["ks"].append(known - rec["output_tokens"])
                rec["output_tokens"] = known
        for req in finished:
            _, rec = live.pop(req.rid)
            rec["e2e"] = t - rec["arrival"]
            rec["finish_reason"] = req.finish_reason.value if req.finish_reason else None
            done += 1
    wall = time.perf_counter() - start
    for rec in recs:
        if rec["times"]:
            rec["ttft"] = rec["times"][0] - rec["arrival"]
            rec["itl"] = itl_samples(rec["times"], rec["ks"])
        else:
            rec["itl"] = []
        rec["ok"] = rec.get("finish_reason") == "length" and rec["output_tokens"] == rec["expected_tokens"]
        rec["error"] = None if rec["ok"] else f"finish {rec.get('finish_reason')}, {rec['output_tokens']}"
        del rec["times"], rec["ks"]
    return recs, wall


def run_inprocess(
    model_path: Path, workloads: list[list[dict]], eargs: dict, args: argparse.Namespace
) -> dict:
    import torch

    from radixserve import Engine

    torch.set_num_threads(args.threads)
    engine = Engine(str(model_path), **eargs)
    out: dict[str, Any] = {"overlap_loop": engine.loop.overlap, "rates": {}}
    try:
        _warm_engine(engine, args.vocab_size)
        for k, (rate, reqs) in enumerate(zip(args.rates, workloads, strict=True)):
            with CpuMeter() as m:
                records, wall = _run_rate_inprocess(engine, reqs, f"r{k}")
            summary = {**summarize(records, wall), **m.record()}
            out["rates"][rate_label(rate)] = {"summary": summary, "requests": [_public(r) for r in records]}
            _progress("inprocess", rate, summary)
    finally:
        engine.shutdown()
    del engine
    gc.collect()
    return out


def _progress(system: str, rate: float, s: dict) -> None:
    print(
        f"{system:9} rate {rate_label(rate):>4}: {s['completed']}/{s['completed'] + s['failed']} ok,"
        f" {s['output_tok_s']:.1f} out tok/s, TTFT p50 {s['ttft_ms_p50']:.0f} ms,"
        f" ITL p50 {s['itl_ms_p50']:.1f} ms, makespan {s['makespan_s']:.1f} s",
        flush=True,
    )


# ---------------------------------------------------------------------------- reporting
def compare(results: dict, rates: list[str]) -> dict:
    per_rate = {}
    for r in rates:
        s, i = results["served"]["rates"][r]["summary"], results["inprocess"]["rates"][r]["summary"]
        per_rate[r] = {
            "output_tok_s_ratio": s["output_tok_s"] / i["output_tok_s"],
            "request_s_ratio": s["request_s"] / i["request_s"],
            "itl_ms_p50_added": s["itl_ms_p50"] - i["itl_ms_p50"],
            "itl_ms_p99_added": s["itl_ms_p99"] - i["itl_ms_p99"],
            "ttft_ms_p50_added": s["ttft_ms_p50"] - i["ttft_ms_p50"],
            "tpot_ms_p50_added": s["tpot_ms_p50"] - i["tpot_ms_p50"],
        }
    sat = "inf" if "inf" in rates else max(rates, key=float)
    worst_itl = max(v["itl_ms_p50_added"] for v in per_rate.values())
    exact = all(results[sys_]["rates"][r]["summary"]["all_exact"] for sys_ in SYSTEMS for r in rates)
    return {
        "per_rate": per_rate,
        "saturation_rate": sat,
        "throughput_ratio_at_saturation": per_rate[sat]["output_tok_s_ratio"],
        f"served_ge_{TARGET_THROUGHPUT_RATIO:g}x_inprocess_at_saturation": per_rate[sat]["output_tok_s_ratio"]
        >= TARGET_THROUGHPUT_RATIO,
        "max_itl_ms_p50_added": worst_itl,
        f"itl_p50_added_le_{TARGET_ITL_ADDED_MS:g}ms_every_rate": worst_itl <= TARGET_ITL_ADDED_MS,
        "every_request_exact": exact,
    }


def format_table(results: dict, rates: list[str], verdict: dict) -> str:
    head = (
        f"{'rate':>5} {'system':9} {'ok':>5} {'out_tok/s':>9} {'req/s':>6} {'ratio':>6} {'TTFT50':>7}"
        f" {'TTFT99':>7} {'ITL50':>6} {'ITL99':>6} {'+ITL50':>6} {'TPOT50':>6} {'e2e50':>7} {'e2e99':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rates:
        for name in SYSTEMS:
            s = results[name]["rates"][r]["summary"]
            v = verdict["per_rate"][r]
            served = name == "served"
            ratio = f"{v['output_tok_s_ratio']:>5.2f}x" if served else f"{'':>6}"
            added = f"{v['itl_ms_p50_added']:>+6.2f}" if served else f"{'':>6}"
            lines.append(
                f"{r:>5} {name:9} {s['completed']:>2}/{s['completed'] + s['failed']:<2} {s['output_tok_s']:>9.1f}"
                f" {s['request_s']:>6.2f} {ratio} {s['ttft_ms_p50']:>7.0f} {s['ttft_ms_p99']:>7.0f}"
                f" {s['itl_ms_p50']:>6.1f} {s['itl_ms_p99']:>6.1f} {added} {s['tpot_ms_p50']:>6.1f}"
                f" {s['e2e_ms_p50']:>7.0f} {s['e2e_ms_p99']:>7.0f}"
            )
    lines.append("(times in ms; ratio = served / in-process output tok/s; +ITL50 = served - in-process)")
    sat = verdict["saturation_rate"]
    ok_t = verdict[f"served_ge_{TARGET_THROUGHPUT_RATIO:g}x_inprocess_at_saturation"]
    ok_i = verdict[f"itl_p50_added_le_{TARGET_ITL_ADDED_MS:g}ms_every_rate"]
    lines.append(
        f"target served >= {TARGET_THROUGHPUT_RATIO:g}x in-process at saturation (rate {sat}):"
        f" {verdict['throughput_ratio_at_saturation']:.2f}x -> {'PASS' if ok_t else 'FAIL'}"
    )
    lines.append(
        f"target median ITL added <= {TARGET_ITL_ADDED_MS:g} ms (every rate): worst"
        f" {verdict['max_itl_ms_p50_added']:+.2f} ms -> {'PASS' if ok_i else 'FAIL'}"
    )
    lines.append(f"every request exact (finish 'length', right token count): {verdict['every_request_exact']}")
    return "\n".join(lines)


def plot(results: dict, rates: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rates)))
    style = {"served": ("#4c72b0", "served (HTTP, gRPC)"), "inprocess": ("#55a868", "in-process Engine")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax, ax2, ax3 = axes
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="HF model folder (default: build the demo model)")
    p.add_argument("--rates", nargs="+", default=None, help=f"req/s, 'inf' = all at once ({FULL['rates']})")
    p.add_argument("--num-requests", type=int, default=None, help=f"per rate (default {FULL['num_requests']})")
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads: the scheduler and in-process (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, few short requests (< 90 s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.rates = [parse_rate(str(r)) for r in args.rates]
    if len({rate_label(r) for r in args.rates}) != len(args.rates):
        p.error("--rates has duplicates")
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    for name in ("input_range", "output_range"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')}: need 1 <= MIN <= MAX")
    return args


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    machine = machine_info()
    tmp = None
    model_path = args.model
    if model_path is None:
        from radixserve.common.demo_model import make_demo_model

        tmp = tempfile.TemporaryDirectory(prefix="radixserve-bench-")
        model_path = make_demo_model(Path(tmp.name) / "model", arch="llama", size=args.model_size, seed=0)
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        args.vocab_size = int(cfg["vocab_size"])
        workloads = [
            build_workload(
                args.num_requests,
                rate,
                tuple(args.input_range),
                tuple(args.output_range),
                args.vocab_size,
                rate_seed(args.seed, k),
            )
            for k, rate in enumerate(args.rates)
        ]
        eargs = engine_args(workloads, args.max_running_requests)
        labels = [rate_label(r) for r in args.rates]
        config = {
            "model": str(args.model) if args.model else f"demo llama/{args.model_size} (built in a temp dir)",
            "quick": args.quick,
            "seed": args.seed,
            "torch_threads": args.threads,
            "rates": labels,
            "num_requests_per_rate": args.num_requests,
            "input_range": list(args.input_range),
            "output_range": list(args.output_range),
            "engine_args": eargs,
            "scheduler_flags": scheduler_flags(eargs),
            "sampling": "greedy (temperature 0), ignore_eos, max_tokens = output length",
            "prompts": "random token ids (special ids avoided), a fresh draw per rate; sent as token ids",
            "arrivals": "Poisson (exponential gaps, first at t=0); inf = all at t=0",
            "itl_definition": "per token: a chunk/step carrying k tokens after a gap g gives k samples g/k;"
            " served chunks assumed 1 token when chunk count == usage.completion_tokens, else each of the"
            " request's gaps is divided by (N-1)/(chunks-1)",
            "workloads": {lab: workload_summary(w) for lab, w in zip(labels, workloads, strict=True)},
        }
        print(f"rates {labels}, {args.num_requests} requests each, engine args {eargs}", flush=True)
        results: dict[str, Any] = {}
        results["served"] = run_served(Path(model_path), workloads, eargs, args)
        results["inprocess"] = run_inprocess(Path(model_path), workloads, eargs, args)
        report: dict[str, Any] = {
            "benchmark": "online serving: radixserve serve (HTTP SSE) vs the Engine in-process, Poisson arrivals",
            "config": config,
            "machine": machine,
            "results": results,
            "verdict": compare(results, labels),
        }
        report["machine"]["torch_threads"] = args.threads
        report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        report["benchmark_wall_s"] = time.perf_counter() - t_start
        return report
    finally:
        if tmp is not None:
            tmp.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    labels = report["config"]["rates"]
    (args.out / "serving.json").write_text(json.dumps(_finite(report), indent=2) + "\n")
    plot(report["results"], labels, args.out / "serving.png")
    print(format_table(report["results"], labels, report["verdict"]))
    print(f"wrote {args.out / 'serving.json'} and {args.out / 'serving.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
