"""The seeded multi-tenant workload: tenant prefixes, requests, their rates and what they add up to."""

from __future__ import annotations

import math
from collections.abc import Sequence

import _common as common


def build_workload(
    num_requests: int,
    rate: float,
    tenants: int,
    prefix_range: tuple[int, int],
    suffix_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> dict:
    """Seeded: ``prefixes`` (one token-id list per tenant) and ``requests`` sorted by arrival, each
    ``arrival`` (s), ``tenant``, ``prefix_len``, ``input_ids`` (prefix + unique suffix), ``output_len``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prefixes = [
        common.random_token_ids(rng, vocab_size, common.draw_len(rng, prefix_range)) for _ in range(tenants)
    ]
    reqs = []
    for t in common.poisson_arrivals(rng, num_requests, rate):
        k = int(rng.integers(tenants))
        suffix = common.random_token_ids(rng, vocab_size, common.draw_len(rng, suffix_range))
        reqs.append(
            {
                "arrival": float(t),
                "tenant": k,
                "prefix_len": len(prefixes[k]),
                "input_ids": prefixes[k] + suffix,
                "output_len": common.draw_len(rng, output_range),
            }
        )
    return {"prefixes": prefixes, "requests": reqs}


def at_rate(wl: dict, base_rate: float, rate: float) -> dict:
    """The same requests arriving at ``rate`` instead of ``base_rate`` (gaps scaled; ``inf``: all at
    t=0), so every rate of a sweep sends the same prompts in the same order."""
    scale = base_rate / rate if math.isfinite(rate) else 0.0
    return {**wl, "requests": [{**r, "arrival": r["arrival"] * scale} for r in wl["requests"]]}


def ideal_hit_rate(reqs: list[dict], page_size: int) -> float:
    """Every tenant on one pod that never evicts it: each request after the tenant's first hits its
    page-aligned prefix (the scheduler caches whole pages)."""
    seen: set[int] = set()
    hit = 0
    for r in reqs:
        if r["tenant"] in seen:
            hit += r["prefix_len"] // page_size * page_size
        seen.add(r["tenant"])
    return hit / max(1, sum(len(r["input_ids"]) for r in reqs))


def workload_summary(wl: dict, page_size: int) -> dict:
    reqs = wl["requests"]
    plens = [len(p) for p in wl["prefixes"]]
    per_tenant = [sum(r["tenant"] == k for r in reqs) for k in range(len(plens))]
    return {
        "num_requests": len(reqs),
        "tenants": len(plens),
        "prefix_lens": plens,
        "requests_per_tenant": per_tenant,
        **common.length_totals(reqs),
        "last_arrival_s": reqs[-1]["arrival"],
        "ideal_hit_rate": ideal_hit_rate(reqs, page_size),
    }


def kv_tokens(prefix_lens: Sequence[int], kv_prefixes: float, page_size: int) -> int:
    """Room for ``kv_prefixes`` mean-length prefixes, rounded up to whole pages."""
    mean = sum(prefix_lens) / len(prefix_lens)
    return math.ceil(kv_prefixes * mean / page_size) * page_size
