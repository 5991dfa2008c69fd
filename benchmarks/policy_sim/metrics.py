"""What a simulated run measured, from its finished ``Req`` objects: hit rates and their ceilings,
queue waits, throughput, and for fairness runs how overdue requests were."""

from __future__ import annotations

import numpy as np

from .workloads import Spec, optimum_cached_tokens


def metrics(specs: list[Spec], sim: dict, fairness_timeout: float | None) -> dict:
    by_rid = {r.rid: r for r in sim["finished"]}
    reqs = [by_rid[s.rid] for s in specs]
    prompt = np.array([r.prompt_len for r in reqs], dtype=np.int64)
    cached = np.array([r.num_cached_tokens for r in reqs], dtype=np.int64)
    wait = np.array([r.admit_time - r.arrival_time for r in reqs])
    out_tokens = sum(len(r.output_ids) for r in reqs)
    st = sim["step_times"]
    m = {
        "num_requests": len(reqs),
        "hit_rate": float(cached.sum() / prompt.sum()),
        "hit_rate_optimum": float(optimum_cached_tokens(specs) / prompt.sum()),
        "wait_p50_s": float(np.percentile(wait, 50)),
        "wait_p99_s": float(np.percentile(wait, 99)),
        "wait_max_s": float(wait.max()),
        "throughput_tok_s": out_tokens / sim["makespan_s"],
        "makespan_s": sim["makespan_s"],
        "utilisation": sim["busy_s"] / sim["makespan_s"],
        "mean_waiting_reqs": sim["queued_req_s"] / sim["makespan_s"],
        "steps": sim["steps"],
        "prefill_steps": sim["prefill_steps"],
        "mean_step_s": float(st.mean()),
        "max_step_s": float(st.max()),
        "retractions": sim["retractions"],
        "output_tokens": out_tokens,
    }
    shared = [(s, by_rid[s.rid]) for s in specs if s.shared_len]
    if shared:
        hit = sum(min(r.num_cached_tokens, s.shared_len) for s, r in shared)
        tot = sum(s.shared_len for s, _ in shared)
        groups: dict[str, int] = {}
        for s, _ in shared:
            groups[s.group] = groups.get(s.group, 0) + s.shared_len
        # One compulsory miss per distinct shared prompt.
        compulsory = sum(next(s.shared_len for s, _ in shared if s.group == g) for g in groups)
        m["shared_prefix_hit_rate"] = hit / tot
        m["shared_prefix_hit_rate_optimum"] = (tot - compulsory) / tot
    if fairness_timeout is not None:
        overdue = np.maximum(0.0, wait - fairness_timeout)
        m["max_overdue_s"] = float(overdue.max())
        m["max_overdue_mean_steps"] = float(overdue.max() / st.mean())
        m["num_overdue_beyond_one_max_step"] = int((overdue > st.max()).sum())
        # The rule fairness actually enforces: once a request is overdue, no younger request is
        # admitted before it. Count (r, q) pairs with q younger, admitted first, while r was overdue.
        arr = np.array([r.arrival_time for r in reqs])
        adm = wait + arr
        younger_first = (arr[None, :] > arr[:, None]) & (adm[None, :] < adm[:, None])
        r_overdue = adm[None, :] - arr[:, None] > fairness_timeout
        m["overtaken_while_overdue"] = int((younger_first & r_overdue).sum())
        # What is left once capacity is taken out: delay from the moment a request is both overdue
        # and the oldest one not yet admitted (every older request admitted) to its admission.
        order = np.argsort(arr, kind="stable")
        older_adm = np.maximum.accumulate(np.concatenate([[-np.inf], adm[order][:-1]]))
        hol = np.empty_like(adm)
        hol[order] = adm[order] - np.maximum(arr[order] + fairness_timeout, older_adm)
        m["max_hol_overdue_s"] = float(max(0.0, hol.max()))
        m["max_hol_overdue_mean_steps"] = m["max_hol_overdue_s"] / float(st.mean())
    return m
