"""The seeded workloads: Poisson requests per rate, closed-loop requests per concurrency and repeat,
and the engine arguments that fit them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import _common as common


def parse_rate(s: str) -> float:
    r = float(s)  # "inf" parses
    if not r > 0:
        raise ValueError(f"a rate must be > 0 (or inf), got {s!r}")
    return r


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
    reqs = []
    for t in common.poisson_arrivals(rng, num_requests, rate):
        n_in = common.draw_len(rng, input_range)
        n_out = common.draw_len(rng, output_range)
        ids = common.random_token_ids(rng, vocab_size, n_in)
        reqs.append({"arrival": float(t), "input_ids": ids, "output_len": n_out})
    return reqs


def rate_seed(seed: int, k: int) -> int:
    return seed * 1000 + k  # a fresh prompt set per rate: no radix-cache hits across rates


def closed_seed(seed: int, k: int, repeat: int = 0) -> int:
    # and per concurrency and repeat, disjoint from the rates' draws (k < 100, repeat < 5)
    return seed * 1000 + 500 + 100 * repeat + k


def build_closed_workload(
    concurrency: int,
    per_client: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[dict]:
    """``concurrency * per_client`` seeded requests; client ``j`` gets ``j, j + C, j + 2C, ...``."""
    reqs = build_workload(concurrency * per_client, math.inf, input_range, output_range, vocab_size, seed)
    return [{**r, "client": i % concurrency} for i, r in enumerate(reqs)]


def workload_summary(reqs: list[dict]) -> dict:
    return {"num_requests": len(reqs), **common.length_totals(reqs), "last_arrival_s": reqs[-1]["arrival"]}


def engine_args(
    workloads: list[list[dict]],
    max_running_requests: int,
    page_size: int = 16,
    closed: Sequence[tuple[int, list[dict]]] = (),
) -> dict:
    """One rate's requests all fit at once (no retraction), and so do any ``C`` requests of a
    closed-loop run at concurrency ``C``; earlier runs' cached prompts get evicted."""

    def size(r: dict) -> int:
        return len(r["input_ids"]) + r["output_len"] + page_size

    need = max(sum(map(size, w)) for w in workloads)
    for c, w in closed:
        need = max(need, sum(sorted(map(size, w))[-c:]))
    return dict(
        page_size=page_size,
        max_total_tokens=need + 64 * page_size,
        max_running_requests=max_running_requests,
    )
