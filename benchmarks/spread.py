"""Does a second scheduler pod add capacity for prompts that share nothing? 1 vs 2 pods, the default
(cache-aware) router vs round-robin, one run.

Workload: ``--num-requests`` prompts of random token ids (``--input-range`` tokens; no two share a
first block, so no prefix cache or prefix routing helps), greedy, ``ignore_eos``, exactly
``--output-range`` tokens each, sent by ``--concurrency`` closed-loop clients (client j sends
requests j, j+C, ... back to back) over HTTP SSE. The same prompts in every configuration. Each
configuration is a fresh ``launcher.build_cluster`` (gateway + pods + detokenizer on loopback, each
pod ``--threads`` torch threads: a pod is a fixed share of the machine, as on a node).

Reported per configuration: output tok/s over the makespan, TTFT p50 / p90 (first non-empty chunk),
requests each pod served (its ``radixserve_scheduler_requests`` counter), failures. 2 pods / 1 pod
throughput is the figure of merit: about 2x when the router keeps both pods busy, 1x when it sends
everything to one.

    .venv/bin/python benchmarks/spread.py [--quick] [--out DIR] [--concurrency C] ...

Writes DIR/spread.json and DIR/spread.png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_*.py
import _common as common
from _common import MODEL_NAME, SPECIAL_IDS
from _machine import machine_info

ROUTERS = ("cache-aware", "round-robin")
CONFIGS = tuple((pods, router) for pods in (1, 2) for router in ROUTERS)

FULL, QUICK = common.presets(
    (  # (setting, full run, --quick)
        ("model_size", "small", "tiny"),
        ("num_requests", 128, 24),
        ("concurrency", 32, 8),
        ("input_range", (64, 256), (24, 64)),
        ("output_range", (32, 64), (8, 16)),
    )
)


def build_workload(
    n: int, inputs: tuple[int, int], outputs: tuple[int, int], vocab: int, seed: int
) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        ids = [SPECIAL_IDS + (i % (vocab - SPECIAL_IDS))]  # a first token of its own: no shared block
        ids += [rng.randrange(SPECIAL_IDS, vocab) for _ in range(rng.randint(*inputs) - 1)]
        reqs.append({"input_ids": ids, "output_len": rng.randint(*outputs), "arrival": 0.0})
    return reqs


async def closed_loop(url: str, reqs: list[dict], concurrency: int) -> tuple[list[common.Stream], float]:
    streams: list[common.Stream | None] = [None] * len(reqs)
    async with common.http_client(concurrency, 600) as client:
        t0 = time.perf_counter()

        async def client_loop(j: int) -> None:
            for k in range(j, len(reqs), concurrency):
                streams[k] = await common.stream_completion(client, url, reqs[k], time.perf_counter())

        await asyncio.gather(*(client_loop(j) for j in range(concurrency)))
        wall = time.perf_counter() - t0
    return [s for s in streams if s is not None], wall


def summarize(reqs: list[dict], streams: list[common.Stream], wall: float, per_pod: list[int]) -> dict:
    ok = [
        s
        for s, r in zip(streams, reqs, strict=True)
        if s.error is None and s.usage and s.usage["completion_tokens"] == r["output_len"]
    ]
    ttft = [s.times[0] - s.sent for s in ok if s.times]
    tokens = sum(s.usage["completion_tokens"] for s in ok if s.usage)
    return {
        "ok": len(ok),
        "failed": len(streams) - len(ok),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        **common.ms_percentiles("ttft", ttft, (50, 90)),
        "requests_per_pod": per_pod,
    }


def run_config(model: Path, pods: int, router: str, reqs: list[dict], args: argparse.Namespace) -> dict:
    from radixserve.launcher import build_cluster, free_port

    cluster = build_cluster(
        model,
        MODEL_NAME,
        port=free_port(),
        schedulers=pods,
        gateway_args=["--router", router],
        torch_threads=args.threads,
    )
    cluster.start()
    try:
        warm = build_workload(2 * pods, (16, 32), (4, 4), args.vocab_size, args.seed + 1)
        asyncio.run(closed_loop(cluster.url, warm, 2 * pods))
        before = cluster.requests_served()
        streams, wall = asyncio.run(closed_loop(cluster.url, reqs, args.concurrency))
        per_pod = [b - a for a, b in zip(before, cluster.requests_served(), strict=True)]
    finally:
        cluster.stop(drain_timeout=2)
    return summarize(reqs, streams, wall, per_pod)


def plot(results: dict, path: Path) -> None:
    plt = common.pyplot()
    labels = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:blue" if "cache-aware" in k else "tab:gray" for k in labels]
    ax1.bar(labels, [results[k]["output_tok_s"] for k in labels], color=colors)
    ax1.set_ylabel("output tok/s")
    ax1.set_title("throughput, unique prompts")
    x = range(len(labels))
    ax2.bar([i - 0.2 for i in x], [results[k]["ttft_ms_p50"] for k in labels], 0.4, label="p50")
    ax2.bar([i + 0.2 for i in x], [results[k]["ttft_ms_p90"] for k in labels], 0.4, label="p90")
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("TTFT (ms)")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=20)
    common.save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_arg(p)
    p.add_argument("--num-requests", type=int, default=None, help=f"({FULL['num_requests']})")
    p.add_argument(
        "--concurrency", type=int, default=None, help=f"closed-loop clients ({FULL['concurrency']})"
    )
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads per pod (1)")
    p.add_argument(
        "--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS), help="the routers to run (both)"
    )
    common.add_run_args(p, quick_help="tiny model, few requests (< 2 min)")
    args = p.parse_args(argv)
    args.routers = [r for r in ROUTERS if r in args.routers]  # a fixed order, each once
    common.fill_defaults(args, FULL, QUICK)
    if args.num_requests < 1 or args.concurrency < 1:
        p.error("--num-requests and --concurrency must be positive")
    common.check_ranges(p, args, ("input_range", "output_range"))
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "1 vs 2 scheduler pods on unique prompts",
        "machine": machine_info(),
    }
    with common.model_folder(args) as model:
        args.vocab_size = common.model_vocab_size(model)
        reqs = build_workload(
            args.num_requests, tuple(args.input_range), tuple(args.output_range), args.vocab_size, args.seed
        )
        results = {}
        for pods, router in CONFIGS:
            if router not in args.routers:
                continue
            key = f"{pods} pod{'s' * (pods > 1)}, {router}"
            results[key] = r = run_config(model, pods, router, reqs, args)
            print(
                f"{key}: {r['ok']}/{len(reqs)} ok, {r['output_tok_s']:.1f} out tok/s, TTFT p50/p90"
                f" {r['ttft_ms_p50']:.0f}/{r['ttft_ms_p90']:.0f} ms, per pod {r['requests_per_pod']}",
                flush=True,
            )
    one = results[f"1 pod, {args.routers[0]}"]["output_tok_s"]  # one pod: the router does not matter
    report["config"] = {
        "model": common.model_description(args),
        "quick": args.quick,
        "seed": args.seed,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "input_range": list(args.input_range),
        "output_range": list(args.output_range),
        "torch_threads_per_pod": args.threads,
        "routers": args.routers,
    }
    report["results"] = results
    report["two_pods_over_one"] = {
        router: results[f"2 pods, {router}"]["output_tok_s"] / one for router in args.routers
    }
    return common.finish_report(report, t_start)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path, png_path = common.write_outputs(
        args.out, "spread", report, lambda p: plot(report["results"], p)
    )
    print("2 pods / 1 pod throughput:", {k: round(v, 2) for k, v in report["two_pods_over_one"].items()})
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
