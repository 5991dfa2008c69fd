"""The disk KV tier's first figures (docs/architecture.md, "KV tiers"): multi-turn conversations through
a device pool and a host tier that hold a fraction of them, with tiers off, host only, and host +
disk, then a *restarted* engine on the disk tier's directory serving the same conversations' next
turn; greedy, CPU by default, the demo llama (``--size``), one run.

Workload: ``--conversations`` conversations x ``--turns`` turns over a shared ``--system``-token
prompt, each with its own ``--opening``-token start; each turn adds a 16-token user message and
the 32-token answer. Turns are interleaved (every conversation's turn 1, then turn 2, ...).

Reported per configuration: prompt tokens computed (prefill), prompt tokens served from a cache
(``cached_tokens``), the first request's cached tokens (the restart), tokens written to and read
from disk, and wall seconds (noisy on a shared machine).

    .venv/bin/python benchmarks/kv_disk_tier.py [--size small] [--out DIR]

Writes DIR/kv_disk_tier.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from radixserve import Engine, SamplingParams
from radixserve.common.demo_model import make_demo_model


def _run(
    model: Path, args: argparse.Namespace, turns: range, history: list[list[int]], **opts: Any
) -> dict[str, Any]:
    greedy = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    cached, first, outs = 0, -1, []
    with Engine(model, max_total_tokens=args.device_tokens, page_size=16, warmup=False, **opts) as engine:
        for _ in turns:
            prompts = []
            for h in history:
                user = rng.integers(5, 200, 16).tolist()
                prompts.append([*h, *user])
            res = engine.generate(input_ids=prompts, sampling_params=greedy)
            assert isinstance(res, list)
            for c, r in enumerate(res):
                history[c] = [*prompts[c], *r["token_ids"]]
                cached += r["meta_info"]["cached_tokens"]
                first = r["meta_info"]["cached_tokens"] if first < 0 else first
                outs.append(r["token_ids"])
        disk = engine.disk
        if disk is not None:
            disk.flush()
        return {
            "prefill_tokens": engine.scheduler.prefill_tokens,
            "cached_tokens": cached,
            "first_request_cached_tokens": first,
            "disk_written_tokens": disk.written_tokens if disk else 0,
            "disk_read_tokens": disk.read_tokens if disk else 0,
            "disk_misses": dict(disk.misses) if disk else {},
            "seconds": round(time.perf_counter() - t0, 2),
            "outputs": outs,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=256)
    p.add_argument("--opening", type=int, default=64)
    p.add_argument("--device-tokens", type=int, default=1536)
    p.add_argument("--host-gb", type=float, default=0.004)  # the small llama: 240 tokens
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kv-disk-"))
    model = make_demo_model(work / "model", arch="llama", size=args.size)
    rng = np.random.default_rng(0)
    system = rng.integers(5, 200, args.system).tolist()
    starts = [[*system, *rng.integers(5, 200, args.opening).tolist()] for _ in range(args.conversations)]
    disk = str(work / "disk")
    tiers = {
        "off": {},
        "host": {"host_kv_cache_gb": args.host_gb},
        "host+disk": {"host_kv_cache_gb": args.host_gb, "kv_disk_cache_dir": disk},
    }
    results: dict[str, Any] = {}
    for name, opts in tiers.items():
        history = [list(s) for s in starts]
        results[name] = _run(model, args, range(args.turns - 1), history, **opts)
        if name == "host+disk":  # a new engine on the directory: the last turn of every conversation
            last = [list(h) for h in history]
            results["restart"] = _run(model, args, range(1), history, **opts)
            results["restart, no disk"] = _run(model, args, range(1), last, **tiers["host"])
    outs = {k: r["outputs"] for k, r in results.items()}
    same = outs["off"] == outs["host"] == outs["host+disk"]
    same_restart = outs["restart"] == outs["restart, no disk"]
    for r in results.values():
        del r["outputs"]
    summary = {"args": vars(args), "greedy_identical": same and same_restart, "results": results}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "kv_disk_tier.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
