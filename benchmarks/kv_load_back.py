"""Load-back from the host KV tier: what one step's copies cost, as the scheduler's metric measures it.

Host pages of an 8B-llama-shaped KV (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB per token)
are loaded into the device pool by ``HostKVPool.run`` with a ``KVLoad``, the object the runner
hands it every step whose batch loads, and whose ``seconds()`` feeds ``radixserve_kv_load_seconds``
(CPU: the copies' wall time; CUDA: the host gather plus the device time between two events). Each
size of ``--tokens`` loads scattered pages (the allocator's layout) ``--repeats`` times after a
warm-up; beside the metric's figure, the wall time around the whole call (CUDA: to a synchronize).

    .venv/bin/python benchmarks/kv_load_back.py [--quick] [--device cpu|cuda] [--out DIR]

Writes DIR/kv_load_back.json (a table; no plot).
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

FULL, QUICK = common.presets(
    (  # (setting, full run, --quick)
        ("tokens", [64, 256, 1024, 2048], [16, 64]),
        ("layers", 32, 2),
        ("kv_heads", 8, 2),
        ("head_dim", 128, 64),
        ("page_size", 16, 16),
        ("repeats", 9, 2),
    )
)


def _measure(args: argparse.Namespace, device: str, tokens: int) -> dict:
    import numpy as np
    import torch

    from radixserve.scheduler.memory.allocator import PagedAllocator
    from radixserve.scheduler.memory.host_pool import HostKVPool, KVLoad
    from radixserve.scheduler.memory.kv_pool import KVPool
    from radixserve.scheduler.memory.tiered_cache import KVTransfers

    ps, pages = args.page_size, -(-tokens // args.page_size)
    shape = (args.layers, args.kv_heads, args.head_dim, torch.bfloat16)
    pool = KVPool((2 * pages + 1) * ps, *shape, device)
    host = HostKVPool((2 * pages + 1) * ps, *shape, torch.device(device))
    rng = np.random.default_rng(args.seed)
    src = PagedAllocator(2 * pages, ps).pages_to_slots(rng.permutation(np.arange(1, 2 * pages + 1))[:pages])
    dst = PagedAllocator(2 * pages, ps).pages_to_slots(rng.permutation(np.arange(1, 2 * pages + 1))[:pages])
    empty = np.zeros(0, dtype=np.int64)
    copies = KVTransfers(empty, empty, src[:tokens], dst[:tokens])
    metric, wall = [], []
    for i in range(args.repeats + 1):  # the first is a warm-up
        load = KVLoad(tokens, tokens * host.bytes_per_slot)
        t0 = time.perf_counter()
        host.run(pool, copies, load)
        host.synchronize()
        t1 = time.perf_counter()
        seconds = load.seconds()
        assert seconds is not None
        if i:
            metric.append(seconds)
            wall.append(t1 - t0)
    nbytes = load.nbytes  # what radixserve_kv_load_bytes_total counts for it
    median = statistics.median(metric)
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "mib": nbytes / 2**20,
        "metric_median_ms": 1e3 * median,
        "metric_best_ms": 1e3 * min(metric),
        "wall_median_ms": 1e3 * statistics.median(wall),
        "gib_per_s": nbytes / median / 2**30,
    }


def run(args: argparse.Namespace) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)
    rows = [_measure(args, device, n) for n in args.tokens]
    return {
        "benchmark": "load-back from the host KV tier: HostKVPool.run timed into a KVLoad (the metric)",
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "device": device,
            "layers_kv_heads_head_dim": [args.layers, args.kv_heads, args.head_dim],
            "dtype": "bfloat16",
            "page_size": args.page_size,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
        },
        "machine": machine_info(),
        "results": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="load sizes, in tokens")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if there is one")
    common.add_run_args(p, quick_help="a 2-layer model, 16 and 64 tokens, 2 repeats (a smoke test)")
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, QUICK)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "kv_load_back.json"
    path.write_text(json.dumps(common.finite(report), indent=2) + "\n")
    for r in report["results"]:
        print(
            f"{r['tokens']:5} tokens ({r['mib']:7.1f} MiB): metric {r['metric_median_ms']:8.2f} ms"
            f" (wall {r['wall_median_ms']:8.2f} ms), {r['gib_per_s']:.2f} GiB/s"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
