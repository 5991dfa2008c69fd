"""The in-process system: the same Engine driven by a loop in this process, Poisson arrivals or
closed-loop clients, one record per request (tokens credited at the end of the step that made them)."""

from __future__ import annotations

import time
from typing import Any

import _common as common

from .analysis import itl_samples


def _finish_inprocess_recs(recs: list[dict]) -> None:
    for rec in recs:
        if rec["times"]:
            rec["ttft"] = rec["times"][0] - rec["arrival"]
            rec["itl"] = itl_samples(rec["times"], rec["ks"])
        else:
            rec["itl"] = []
        rec["ok"] = rec.get("finish_reason") == "length" and rec["output_tokens"] == rec["expected_tokens"]
        rec["error"] = None if rec["ok"] else f"finish {rec.get('finish_reason')}, {rec['output_tokens']}"
        del rec["times"], rec["ks"]


def _step_inprocess(engine: Any, live: dict, start: float) -> tuple[list[dict], float]:
    """One engine step; new tokens go to their records at the step's end. Returns the records of
    the requests that finished in it (e2e and finish reason set) and the step's end time."""
    finished = engine.loop.step().finished
    t = time.perf_counter() - start
    for req, rec in live.values():
        known = req.known_len - req.prompt_len
        if known > rec["output_tokens"]:
            rec["times"].append(t)
            rec["ks"].append(known - rec["output_tokens"])
            rec["output_tokens"] = known
    done = []
    for req in finished:
        _, rec = live.pop(req.rid)
        rec["e2e"] = t - rec["arrival"]
        rec["finish_reason"] = req.finish_reason.value if req.finish_reason else None
        done.append(rec)
    return done, t


def _add_inprocess(engine: Any, live: dict, rid: str, r: dict, rec: dict) -> None:
    from radixserve import SamplingParams
    from radixserve.scheduler.req import Req

    sp = SamplingParams(max_new_tokens=r["output_len"], temperature=0.0, ignore_eos=True)
    sp.validate()
    req = Req(rid, list(r["input_ids"]), sp)
    engine.scheduler.add(req)
    live[req.rid] = (req, rec)


def run_rate_inprocess(engine: Any, reqs: list[dict], tag: str) -> tuple[list[dict], float]:
    """Poisson: each request is added at its scheduled arrival (checked before every step)."""
    recs = [common.new_record(r, times=[], ks=[]) for r in reqs]
    live: dict[str, tuple[Any, dict]] = {}
    done = 0
    nxt = 0
    start = time.perf_counter()
    while done < len(reqs):
        now = time.perf_counter() - start
        while nxt < len(reqs) and reqs[nxt]["arrival"] <= now:
            _add_inprocess(engine, live, f"{tag}-{nxt}", reqs[nxt], recs[nxt])
            nxt += 1
        if not engine.loop.busy:
            if nxt < len(reqs):
                time.sleep(max(0.0, reqs[nxt]["arrival"] - (time.perf_counter() - start)))
            continue
        finished, _ = _step_inprocess(engine, live, start)
        done += len(finished)
    wall = time.perf_counter() - start
    _finish_inprocess_recs(recs)
    return recs, wall


def run_closed_inprocess(
    engine: Any, reqs: list[dict], concurrency: int, tag: str
) -> tuple[list[dict], float]:
    """Closed loop: client ``j`` runs requests ``j, j + C, j + 2C, ...`` back to back; the first of
    each at t=0, the next one added right after the step that finished the previous one (so it
    joins at the next step). ``arrival`` is the time it was added."""
    recs = [common.new_record(r, times=[], ks=[]) for r in reqs]
    index = {id(rec): i for i, rec in enumerate(recs)}
    live: dict[str, tuple[Any, dict]] = {}
    start = time.perf_counter()

    def add(i: int) -> None:
        recs[i]["arrival"] = time.perf_counter() - start
        recs[i]["client"] = i % concurrency
        _add_inprocess(engine, live, f"{tag}-{i}", reqs[i], recs[i])

    for i in range(min(concurrency, len(reqs))):
        add(i)
    done = 0
    while done < len(reqs):
        if not engine.loop.busy:
            raise RuntimeError(f"closed loop {tag}: engine idle with {len(reqs) - done} requests left")
        finished, _ = _step_inprocess(engine, live, start)
        done += len(finished)
        for rec in finished:
            nxt = index[id(rec)] + concurrency
            if nxt < len(reqs):
                add(nxt)
    wall = time.perf_counter() - start
    _finish_inprocess_recs(recs)
    return recs, wall
