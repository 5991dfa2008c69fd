"""Prefix caching on a hybrid model (Gated DeltaNet + gated full attention): a shared-system-prompt
workload on the Engine with the state-snapshot cache on and off, and the same workload on a dense
model, in one run on CPU.

* Models: the demo ``qwen3_5`` hybrid (services/common/demo_hybrid.py; "small": 16 layers, 12
  linear and 4 full attention, hidden 512) and, for the hit-rate comparison, the dense demo
  ``qwen3`` of the same size preset (8 layers, hidden 512). ``--quick``: the tiny ones.
* Workload: ``--num-requests`` prompts, each one system prompt of ``--system-len`` tokens shared by
  all, then a user part of ``--user-range`` tokens of its own; ``--new-tokens`` greedy tokens each.
  They arrive in waves of ``--concurrency`` (a wave is one ``Engine.generate`` call; the next
  starts when it has finished): a chat service's steady trickle, not one burst.
* Systems: ``hybrid_snapshots`` (the default engine: the radix tree keeps recurrent-state
  snapshots, memory/hybrid_cache.py), ``hybrid_no_snapshots`` (``max_state_snapshots=0``: the KV
  is cached but no prefix can be resumed, what an engine without snapshots does), ``dense`` (the
  dense model, radix cache on); and the hybrid with snapshots and the dense model again with one
  request at a time (``*_one_at_a_time``: no wave whose leader snapshots where its followers
  leave the prompt, so the hybrid's second request recomputes the system prompt).
* Per system: prompt tokens computed (``BatchScheduler.prefill_tokens``), the hit rate (cached /
  prompt tokens, as ``cached_tokens`` reports them), TTFT per request (from its wave's start to
  the step that sampled its first token), the run's wall time and output tokens per second.
  Greedy outputs of the two hybrid systems must be equal (``outputs_equal``). Each engine is warmed
  up first (untimed) on a wave like the workload's, and torch runs ``--threads`` threads (1).

    .venv/bin/python benchmarks/hybrid.py [--quick] [--out DIR] [flags below]
    radixserve bench hybrid [same flags]

Writes DIR/hybrid.json and DIR/hybrid.png. Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_*.py
import _common as common
from _machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
FULL = dict(size="small", num_requests=16, concurrency=4, system_len=600, user_range=(16, 64), new_tokens=16)
QUICK = dict(size="tiny", num_requests=12, concurrency=3, system_len=160, user_range=(8, 24), new_tokens=4)
SYSTEMS = ("hybrid_snapshots", "hybrid_no_snapshots", "dense")
# the hit rates again with one request at a time: no wave for a leader to snapshot for
SEQUENTIAL = ("hybrid_snapshots_one_at_a_time", "dense_one_at_a_time")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="radixserve bench hybrid", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models and a short workload (smoke run)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--system-len", type=int)
    p.add_argument("--user-range", type=int, nargs=2)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if min(args.num_requests, args.concurrency, args.system_len, args.new_tokens) < 1:
        p.error("--num-requests, --concurrency, --system-len and --new-tokens must be >= 1")
    return args


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    system = common.random_token_ids(rng, vocab, args.system_len)
    return [
        system + common.random_token_ids(rng, vocab, common.draw_len(rng, tuple(args.user_range)))
        for _ in range(args.num_requests)
    ]


def warm(engine: Any, args: argparse.Namespace, vocab: int) -> None:
    """Untimed: the short warm-up of every benchmark, then a wave like the workload's (prompts longer
    than a prefill chunk, sharing a prefix) on other tokens: the first chunked prefill, snapshot cut
    and resume of a process cost several times a later one's, and would land on the first system."""
    import numpy as np

    from radixserve import SamplingParams

    common.warm_engine(engine, vocab)
    rng = np.random.default_rng(args.seed + 1)
    shared = common.random_token_ids(rng, vocab, args.chunked_prefill_size + 40)
    prompts = [shared + common.random_token_ids(rng, vocab, 20) for _ in range(2)]
    greedy = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    for _ in range(2):  # cold, then resumed
        engine.generate(input_ids=prompts, sampling_params=greedy)


def serve(
    path: Path, prompts: list[list[int]], args: argparse.Namespace, concurrency: int, **engine_args: Any
) -> dict:
    """The workload on one engine, in waves of ``concurrency``: its figures and its outputs."""
    from radixserve import Engine, SamplingParams
    from radixserve.scheduler.batch import ForwardMode
    from radixserve.scheduler.event_loop import Step

    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    with Engine(
        path, device="cpu", page_size=args.page_size, chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=max(8, concurrency), **engine_args,
    ) as engine:  # fmt: skip
        warm(engine, args, common.model_vocab_size(path))
        s = engine.scheduler
        computed0 = s.prefill_tokens
        first: dict[str, float] = {}

        def on_step(step: Step) -> None:
            for pb in step.batches:
                b = pb.batch
                if b.mode is ForwardMode.EXTEND:
                    for req, idx in zip(b.reqs, b.token_index.tolist(), strict=True):
                        if idx == 0:
                            first.setdefault(req.rid, pb.processed)

        outs, ttft = [], []
        t0 = time.perf_counter()
        for w in range(0, len(prompts), concurrency):
            wave = prompts[w : w + concurrency]
            first.clear()
            start = time.perf_counter()
            got = engine.generate(input_ids=wave, sampling_params=greedy, on_step=on_step)
            ttft += [t - start for t in first.values()]
            outs += got
        wall = time.perf_counter() - t0
        kv = s.kv
        states = kv.states.hybrid if kv.states is not None else None
        snapshots = states.snapshots.capacity if states is not None else None
        pools_free = kv.available() == kv.capacity and kv.req_to_token.num_free == kv.req_to_token.max_running
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": s.prefill_tokens - computed0,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens,
        **common.ms_percentiles("ttft", ttft, (50, 95)),
        "ttft_ms_mean": 1000 * sum(ttft) / len(ttft),
        "wall_s": wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "state_snapshots": snapshots,
        "pools_free_after": pools_free,
        "outputs": [o["token_ids"] for o in outs],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from radixserve.common.demo_model import make_demo_model

    # One thread, as bench offline: on a shared 2-core machine two OpenMP threads spin against the
    # other processes, and the small ops of the linear layers' prefill then take seconds each.
    torch.set_num_threads(args.threads)
    t_start, machine = time.perf_counter(), machine_info()
    with tempfile.TemporaryDirectory(prefix="radixserve-bench-hybrid-") as tmp:
        hybrid = make_demo_model(Path(tmp) / "hybrid", arch="qwen3_5", size=args.size, seed=0)
        dense = make_demo_model(Path(tmp) / "dense", arch="qwen3", size=args.size, seed=0)
        prompts = workload(args, common.model_vocab_size(hybrid))
        c = args.concurrency
        results = {
            "hybrid_snapshots": serve(hybrid, prompts, args, c),
            "hybrid_no_snapshots": serve(hybrid, prompts, args, c, max_state_snapshots=0),
            "dense": serve(dense, prompts, args, c),
            "hybrid_snapshots_one_at_a_time": serve(hybrid, prompts, args, 1),
            "dense_one_at_a_time": serve(dense, prompts, args, 1),
        }
    equal = results["hybrid_snapshots"]["outputs"] == results["hybrid_no_snapshots"]["outputs"]
    for r in results.values():
        del r["outputs"]
    on, off, dense_r = results["hybrid_snapshots"], results["hybrid_no_snapshots"], results["dense"]
    report = {
        "benchmark": "hybrid prefix caching: a shared system prompt, state snapshots on vs off, and dense",
        "config": {
            "hybrid_model": f"demo qwen3_5/{args.size} (built in a temp dir)",
            "dense_model": f"demo qwen3/{args.size} (built in a temp dir)",
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "system_len": args.system_len,
            "user_range": list(args.user_range),
            "new_tokens": args.new_tokens,
            "page_size": args.page_size,
            "chunked_prefill_size": args.chunked_prefill_size,
            "seed": args.seed,
            "device": "cpu",
            "torch_threads": args.threads,
        },
        "machine": machine,
        "results": results,
        "summary": {
            "outputs_equal": equal,
            "prefill_tokens_saved": 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
            "ttft_speedup_mean": off["ttft_ms_mean"] / on["ttft_ms_mean"],
            "throughput_speedup": on["total_tok_s"] / off["total_tok_s"],
            "hit_rate_hybrid": on["hit_rate"],
            "hit_rate_dense": dense_r["hit_rate"],
            "hit_rate_relative_to_dense": on["hit_rate"] / dense_r["hit_rate"],
            "hit_rate_relative_to_dense_one_at_a_time": results["hybrid_snapshots_one_at_a_time"]["hit_rate"]
            / results["dense_one_at_a_time"]["hit_rate"],
        },
    }
    return common.finish_report(report, t_start)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    res = report["results"]
    labels = ["hybrid\nsnapshots on", "hybrid\nsnapshots off", "dense\n(radix cache)"]
    colors = ["#55a868", "#c44e52", "#999999"]
    panels = [
        ("prefill_tokens_computed", "prompt tokens computed", "{:.0f}"),
        ("hit_rate", "prefix hit rate (cached / prompt tokens)", "{:.1%}"),
        ("ttft_ms_mean", "mean TTFT (ms)", "{:.0f}"),
        ("total_tok_s", "throughput (prompt + output tok/s)", "{:.0f}"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4))
    for ax, (key, title, fmt) in zip(axes, panels, strict=True):
        names, names_labels, names_colors = SYSTEMS, labels, colors
        if key == "hit_rate":  # with the one-at-a-time runs beside them
            names = SYSTEMS + SEQUENTIAL
            names_labels = [*labels, "hybrid on\none at a time", "dense\none at a time"]
            names_colors = [*colors, "#8fd19e", "#cccccc"]
        values = [res[s][key] for s in names]
        ax.bar(names_labels, values, color=names_colors)
        ax.tick_params(axis="x", labelsize=7)
        for i, v in enumerate(values):
            ax.annotate(fmt.format(v), (i, v), ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, max(values) * 1.25 or 1)
        ax.set_title(title, fontsize=9)
    c = report["config"]
    fig.suptitle(
        f"{c['hybrid_model']}: {c['num_requests']} requests sharing a {c['system_len']}-token system prompt, "
        f"waves of {c['concurrency']}, CPU",
        fontsize=10,
    )
    common.save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path, png_path = common.write_outputs(args.out, "hybrid", report, lambda path: plot(report, path))
    s, r = report["summary"], report["results"]
    for name in SYSTEMS + SEQUENTIAL:
        x = r[name]
        print(
            f"{name:20s} computed {x['prefill_tokens_computed']:6d} of {x['prompt_tokens']:6d} prompt "
            f"tokens, hit rate {x['hit_rate']:.1%}, mean TTFT {x['ttft_ms_mean']:.0f} ms, "
            f"{x['total_tok_s']:.0f} tok/s"
        )
    print(
        f"snapshots save {s['prefill_tokens_saved']:.1%} of prefill, TTFT {s['ttft_speedup_mean']:.2f}x, "
        f"throughput {s['throughput_speedup']:.2f}x; hit rate {s['hit_rate_relative_to_dense']:.1%} of the "
        f"dense model's ({s['hit_rate_relative_to_dense_one_at_a_time']:.1%} one at a time); outputs equal: "
        f"{s['outputs_equal']}"
    )
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
