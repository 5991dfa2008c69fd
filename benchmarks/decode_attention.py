"""Decode attention per layer: the ``torch`` backend (gather + SDPA per request) vs ``cpu`` (C kernel).

One decode step's attention for one layer, as the engine runs it: ``--batch`` requests with
contexts drawn from ``--context-range`` tokens, each on pages of ``--page-size`` slots scattered
over a pool of ``--pool-slots`` (the allocator's layout), the small demo model's shapes (8 query
heads, 4 KV heads, head_dim 64), fp32, one torch thread. Each backend runs ``--repeats`` times after
a warm-up; the best and the median wall time per call are reported, and the two outputs are compared.

    .venv/bin/python benchmarks/decode_attention.py [--quick] [--out DIR]

Writes DIR/decode_attention.json (a table; no plot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_*.py
import _common as common
from _machine import machine_info

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64  # the small demo model

FULL, QUICK = common.presets(
    (  # (setting, full run, --quick)
        ("batch", 36, 4),
        ("context_range", (100, 700), (20, 60)),
        ("pool_slots", 40_000, 2_048),
        ("page_size", 16, 16),
        ("repeats", 30, 3),
    )
)


def build(args: argparse.Namespace):
    import numpy as np
    import torch

    from radixserve.scheduler.batch import ForwardMode
    from radixserve.scheduler.memory.kv_pool import KVPool
    from radixserve.scheduler.memory.req_to_token import ReqToTokenPool
    from radixserve.scheduler.model.forward_batch import ForwardBatch

    rng = np.random.default_rng(args.seed)
    lens = [common.draw_len(rng, tuple(args.context_range)) for _ in range(args.batch)]
    ps = args.page_size
    if sum(-(-n // ps) for n in lens) > args.pool_slots // ps:
        raise SystemExit("--pool-slots too small for the contexts")
    pool = KVPool(args.pool_slots, 1, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    g = torch.Generator().manual_seed(args.seed)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=g))
    table = ReqToTokenPool(args.batch, max(lens))
    pages = iter(rng.permutation(args.pool_slots // ps))
    for i, n in enumerate(lens):
        slots = np.concatenate(
            [np.arange(p * ps, p * ps + ps) for p in (next(pages) for _ in range(-(-n // ps)))]
        )
        table.host[i, :n] = slots[:n]
    b = len(lens)
    last = torch.from_numpy(table.host[np.arange(b), np.array(lens) - 1].astype(np.int64))
    fb = ForwardBatch.for_attention(ForwardMode.DECODE, np.array(lens) - 1, np.ones(b), last)
    q = torch.randn(b, HEADS, HEAD_DIM, generator=g)
    k_new, v_new = pool.k[0][last].clone(), pool.v[0][last].clone()  # rewrite what is there
    return pool, table, fb, np.arange(b), q, k_new, v_new, lens


def run(args: argparse.Namespace) -> dict:
    import torch

    from radixserve.scheduler.model.attention import make_backend

    torch.set_num_threads(1)
    pool, table, fb, rows, q, k_new, v_new, lens = build(args)
    results, outs = {}, {}
    for name in ("torch", "cpu"):
        backend = make_backend(name, pool, table, HEADS, HEAD_DIM, args.page_size)
        backend.prepare(fb, rows)
        outs[name] = backend.forward(0, q, k_new, v_new, fb)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            backend.forward(0, q, k_new, v_new, fb)
            times.append(time.perf_counter() - t)
        results[name] = {"best_ms": 1e3 * min(times), "median_ms": 1e3 * statistics.median(times)}
    diff = float((outs["cpu"] - outs["torch"]).abs().max())
    return {
        "benchmark": "decode attention, one layer: torch (gather + SDPA) vs cpu (C kernel over the pool)",
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "batch": args.batch,
            "context_lens_mean": sum(lens) / len(lens),
            "context_range": list(args.context_range),
            "pool_slots": args.pool_slots,
            "page_size": args.page_size,
            "heads_kv_heads_head_dim": [HEADS, KV_HEADS, HEAD_DIM],
            "repeats": args.repeats,
            "torch_threads": 1,
        },
        "machine": machine_info(),
        "results": results,
        "speedup_median": results["torch"]["median_ms"] / results["cpu"]["median_ms"],
        "max_abs_diff": diff,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--context-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--pool-slots", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    common.add_run_args(p, quick_help="4 short requests, 3 repeats (a smoke test)")
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, QUICK)
    common.check_ranges(p, args, ("context_range",))
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "decode_attention.json"
    path.write_text(json.dumps(common.finite(report), indent=2) + "\n")
    for name, r in report["results"].items():
        print(f"{name:6} best {r['best_ms']:.2f} ms  median {r['median_ms']:.2f} ms per layer call")
    speedup, diff = report["speedup_median"], report["max_abs_diff"]
    ctx = report["config"]["context_lens_mean"]
    print(f"cpu / torch (median) {speedup:.2f}x, max |diff| {diff:.1e}; mean context {ctx:.0f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
