"""Tensor parallelism: offline throughput with the model split over 1 vs 2 processes, same workload.

Each configuration is a fresh ``Engine(model, tp_size=TP, device=--device)`` (TP > 1: this process
is rank 0 and runs the scheduler, TP - 1 follower processes hold the other shards; gloo on CPU,
NCCL on CUDA). One seeded workload (benchmarks/offline's generator, no shared prefix): ``--num-requests``
prompts of random token ids, lengths uniform in ``--input-range``, greedy, ``ignore_eos``, output
lengths uniform in ``--output-range``, all submitted to one ``generate`` call after an untimed
warm-up call. The KV pool is sized to hold the whole workload (no retraction, no eviction), the
same in every configuration.

Threads (CPU): every rank process takes the parent's ``torch.get_num_threads()``, so the parent's is
set per configuration: tp=1 with all ``--cores``, tp=N with ``cores / N`` per rank (the same cores in
all), and tp=1 with ``cores / N`` too (the same threads per process: what a second process adds).
With ``--attention-backend auto`` (the engine's default) a 1-thread engine decodes with the C
attention kernel and a multi-thread one with the torch path (``attention_backend`` in each result);
``--attention-backend cpu`` pins the C kernel in every configuration.

Every configuration runs ``--repeats`` times, back to back in alternating order (configurations
in order, then reversed, ...). Reported per configuration (the median, and every repeat): output
tok/s, total (prompt + output) tok/s, wall time, ms per engine step, each rank's CPU time / wall,
and the placement (``engine.placement``: weight bytes per rank, KV tokens and KV bytes per rank).
``same_tokens``: every tp > 1 run's greedy tokens equal tp=1's. Nothing is asserted about speed.

    .venv/bin/python benchmarks/tensor_parallel.py [--smoke] [--out DIR] [--device cpu] ...
    radixserve bench tensor_parallel [same flags]

Writes DIR/tensor_parallel.json and DIR/tensor_parallel.png.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_*.py
import _common as common
import offline  # its workload generator and engine arguments
from _machine import machine_info

NAME = "tensor_parallel"

FULL, SMOKE = common.presets(
    (  # (setting, full run, --smoke)
        ("model_size", "small", "tiny"),
        ("num_requests", 64, 8),
        ("input_range", (64, 512), (16, 48)),
        ("output_range", (32, 256), (8, 16)),
        ("repeats", 3, 1),
    )
)


# ------------------------------------------------------------------------ configurations
def config_key(tp: int, threads: int) -> str:
    return f"tp{tp}_threads{threads}"


def configurations(tp_sizes: Sequence[int], cores: int, cpu: bool) -> list[dict]:
    """``(tp, threads per rank)`` to run: each tp with ``cores / tp`` threads per rank; on CPU also
    tp=1 with each tp's per-rank threads (the same threads per process). Duplicates once."""
    pairs = [(tp, max(1, cores // tp)) for tp in tp_sizes]
    if cpu:
        pairs += [(1, max(1, cores // tp)) for tp in tp_sizes if tp > 1]
    out: list[dict] = []
    for tp, threads in pairs:
        key = config_key(tp, threads)
        if key not in {c["key"] for c in out}:
            out.append({"key": key, "tp_size": tp, "threads_per_rank": threads})
    return out


def config_label(c: dict) -> str:
    t = c["threads_per_rank"]
    per = " per rank" if c["tp_size"] > 1 else ""
    return f"tp={c['tp_size']}\n{t} thread{'s' * (t > 1)}{per}"


# ------------------------------------------------------------------------------ one run
def run_once(model: Path, c: dict, reqs: list[dict], args: argparse.Namespace) -> tuple[dict, list]:
    """One fresh engine in configuration ``c``: warm-up, then the whole workload, timed."""
    import torch

    from radixserve import Engine
    from radixserve.scheduler.event_loop import LoopStats

    torch.set_num_threads(c["threads_per_rank"])  # rank 0's; the followers copy it at start
    t0 = time.perf_counter()
    eargs = {**args.engine_args, "attention_backend": args.attention_backend}
    with Engine(str(model), tp_size=c["tp_size"], device=args.device, **eargs) as engine:
        startup_s = time.perf_counter() - t0
        pids = [p.pid for p in engine.followers.procs] if engine.followers is not None else []
        common.warm_engine(engine, args.vocab_size)
        stats = engine.loop.stats = LoopStats()  # count the timed run only
        sampling = offline.greedy_sampling(reqs)
        followers_cpu0 = [common.proc_cpu_seconds(f"/proc/{pid}/stat") for pid in pids]
        with common.Meter() as m:
            outs = engine.generate(input_ids=[r["input_ids"] for r in reqs], sampling_params=sampling)
        followers_cpu1 = [common.proc_cpu_seconds(f"/proc/{pid}/stat") for pid in pids]
        placement = dict(engine.placement)
        backend = engine.profile.attention_backend
        device = str(engine.profile.device)
        steps = stats.steps
    gc.collect()
    tokens = [o["token_ids"] for o in outs]
    prompt_tokens = sum(len(r["input_ids"]) for r in reqs)
    output_tokens = sum(len(t) for t in tokens)
    rank_cpu = [m.cpu_s] + [
        b - a if a is not None and b is not None else None
        for a, b in zip(followers_cpu0, followers_cpu1, strict=True)
    ]
    rec = {
        "wall_s": m.wall_s,
        "output_tok_s": output_tokens / m.wall_s,
        "total_tok_s": (prompt_tokens + output_tokens) / m.wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "outputs_exact": all(len(t) == r["output_len"] for t, r in zip(tokens, reqs, strict=True)),
        "steps": steps,
        "ms_per_step": 1e3 * m.wall_s / max(1, steps),
        "rank_cpu_s": rank_cpu,  # rank 0: this process (every thread); others: /proc
        "rank_cpu_per_wall": [None if s is None else s / m.wall_s for s in rank_cpu],
        "loadavg_1m_before_after": m.loadavg_before_after(),
        "engine_startup_s": startup_s,
        "attention_backend": backend,
        "device": device,
        "placement": placement,
    }
    return rec, tokens


# ------------------------------------------------------------------------------ summary
def median_index(xs: Sequence[float]) -> int:
    """The index of the median value (the lower middle one for an even count)."""
    return sorted(range(len(xs)), key=xs.__getitem__)[(len(xs) - 1) // 2]


def summarize(c: dict, runs: list[dict], same: list[bool | None]) -> dict:
    """One configuration: its median repeat's figures, every repeat's, and the placement."""
    tps = [r["output_tok_s"] for r in runs]
    mid = runs[median_index(tps)]
    return {
        "tp_size": c["tp_size"],
        "threads_per_rank": c["threads_per_rank"],
        "output_tok_s": statistics.median(tps),
        "total_tok_s": statistics.median(r["total_tok_s"] for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
        "repeats_output_tok_s": tps,
        "repeats_total_tok_s": [r["total_tok_s"] for r in runs],
        "repeats_wall_s": [r["wall_s"] for r in runs],
        "weight_bytes_per_rank": mid["placement"]["weight_bytes_per_rank"],
        "kv_tokens": mid["placement"]["kv_tokens"],
        "kv_bytes_per_rank": mid["placement"]["kv_bytes_per_rank"],
        "attention_backend": mid["attention_backend"],
        "device": mid["device"],
        "outputs_exact": all(r["outputs_exact"] for r in runs),
        "same_tokens_as_tp1": None if any(s is None for s in same) else all(same),
        "median_run": {k: v for k, v in mid.items() if k != "placement"},
        "runs": runs,
    }


def ratios(results: dict, configs: list[dict], cores: int) -> dict:
    """Each tp > 1 configuration over tp=1 with all cores and over tp=1 with its threads per
    process: the medians' ratio, and the ratio within each repeat (same position in the order)."""
    out = {}
    for c in configs:
        if c["tp_size"] == 1:
            continue
        for base_name, threads in (("tp1_all_cores", cores), ("tp1_same_threads", c["threads_per_rank"])):
            base = config_key(1, threads)
            if base == c["key"] or base not in results:
                continue
            a, b = results[c["key"]], results[base]
            out[f"{c['key']}_vs_{base_name}"] = {
                "baseline": base,
                "output_tok_s_ratio": a["output_tok_s"] / b["output_tok_s"],
                "each_repeat": [
                    x / y for x, y in zip(a["repeats_output_tok_s"], b["repeats_output_tok_s"], strict=True)
                ],
            }
    return out


def rounded(xs: Sequence[float | None]) -> list[float | None]:
    return [None if x is None else round(x, 2) for x in xs]


def make_note(cores: int, cpu: bool, results: dict, speed: dict) -> str:
    """What the figures mean, with the ones that say it."""
    figures = "; ".join(f"{k} {v['output_tok_s_ratio']:.2f}x" for k, v in speed.items()) or "n/a"
    split = [
        f"{k}: weights per rank {[round(w / 2**20, 1) for w in r['weight_bytes_per_rank']]} MiB, "
        f"rank CPU / wall {rounded(r['median_run']['rank_cpu_per_wall'])}"
        for k, r in results.items()
        if r["tp_size"] > 1
    ]
    common_part = (
        f"Ratios of median output tok/s: {figures}. {'; '.join(split)}. Each step, every rank all-reduces "
        "for the embedding and twice per layer, all-gathers the logits, and rank 0 broadcasts the "
        "sampled tokens and pickles the step's plan to each follower. "
    )
    if not cpu:
        return "Each rank has its own GPU (NCCL). " + common_part
    backends = {k: r["attention_backend"] for k, r in results.items()}
    mixed = (
        f"The attention backends differ ({backends}): --attention-backend auto picks the single-threaded"
        " C decode kernel at 1 torch thread and the torch path above, so tp=1 with all cores also changes"
        " kernel; --attention-backend cpu pins one kernel for every configuration."
        if len(set(backends.values())) > 1
        else ""
    )
    return (
        f"CPU, {cores} cores shared by every rank: a second process brings no compute that tp=1 with all "
        "cores lacks, and adds collectives over gloo (loopback TCP): tp=N vs tp=1 with all cores asks "
        "whether processes beat intra-op threads on the same cores; tp=N vs tp=1 with the same threads per "
        "process shows what the extra processes (each with 1/N of every matmul) add. With few cores the "
        "collectives and the extra process can cost as much as the split saves; a rank's CPU / wall below "
        "its threads is time spent waiting for the other rank. On GPUs, where each rank has its own device "
        "and memory bandwidth, these CPU figures do not predict the speedup. " + common_part + mixed + " "
        "Another process on the machine moves single runs (loadavg_1m_before_after, rank_cpu_per_wall in "
        "each run); every repeat is listed."
    )


# ------------------------------------------------------------------------------- plot
def plot(report: dict, path: Path) -> None:
    plt = common.pyplot()
    results, configs = report["results"], report["config"]["configurations"]
    labels = [config_label(c) for c in configs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    colors = ["#4c72b0" if c["tp_size"] == 1 else "#dd8452" for c in configs]
    for ax, metric, title in (
        (axes[0], "output_tok_s", "output tokens / s"),
        (axes[1], "total_tok_s", "prompt + output tokens / s"),
    ):
        meds = [results[c["key"]][metric] for c in configs]
        ax.bar(range(len(configs)), meds, color=colors)
        for i, c in enumerate(configs):
            each = results[c["key"]][f"repeats_{metric}"]
            ax.plot([i] * len(each), each, "k.", alpha=0.6)
            text = f"{meds[i]:.0f}"
            if metric == "output_tok_s" and c["tp_size"] > 1:
                text += "".join(
                    f"\n{v['output_tok_s_ratio']:.2f}x {v['baseline']}"
                    for k, v in report["speedup"].items()
                    if k.startswith(c["key"] + "_vs_")
                )
            ax.annotate(text, (i, max(meds[i], *each)), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(configs)), labels)
        ax.set_ylim(0, max(max(results[c["key"]][f"repeats_{metric}"]) for c in configs) * 1.3)
        ax.set_ylabel(title)
    cfg = report["config"]
    same = report["same_tokens"]
    fig.suptitle(
        f"Tensor parallelism, {cfg['device']}, {cfg['cores']} cores, {cfg['model']} "
        f"(bars: median of {cfg['repeats']}, dots: each repeat; same tokens as tp=1: {same})",
        fontsize=10,
    )
    common.save_figure(fig, path)


# ------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_arg(p)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2], help="tp sizes to run (1 2)")
    p.add_argument(
        "--cores",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="cores the threads are split over (default: the CPUs this process may use)",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help=f"runs of each configuration ({FULL['repeats']})"
    )
    p.add_argument("--num-requests", type=int, default=None, help=f"({FULL['num_requests']})")
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="the engine's (auto: the C kernel at 1 thread, else torch)",
    )
    p.add_argument("--page-size", type=int, default=16)
    common.add_run_args(p, quick_help="the same as --smoke")
    p.add_argument(
        "--smoke", dest="quick", action="store_true", help="tiny model, few requests, 1 repeat (< 60 s)"
    )
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, SMOKE)
    args.smoke = args.quick
    common.check_ranges(p, args, ("input_range", "output_range"))
    if args.num_requests < 1 or args.repeats < 1 or args.cores < 1 or min(args.tp_sizes) < 1:
        p.error("--num-requests, --repeats, --cores and --tp-sizes must be positive")
    return args


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def runnable(configs: list[dict], device: str) -> tuple[list[dict], list[str]]:
    """On CUDA, the configurations with a device for every rank, and the keys of the others."""
    import torch

    if not device.startswith("cuda"):
        return configs, []
    first, n_gpus = torch.device(device).index or 0, torch.cuda.device_count()
    skipped = [c["key"] for c in configs if first + c["tp_size"] > n_gpus]
    if skipped:
        print(f"skipped (only {n_gpus} CUDA devices from {device}): {skipped}", flush=True)
    return [c for c in configs if c["key"] not in skipped], skipped


def measure(
    model: Path, configs: list[dict], reqs: list[dict], args: argparse.Namespace
) -> tuple[dict[str, list[dict]], dict[str, list[list]]]:
    """Every configuration ``--repeats`` times, alternating the order; each run's record and tokens."""
    import torch

    runs: dict[str, list[dict]] = {c["key"]: [] for c in configs}
    tokens: dict[str, list[list]] = {c["key"]: [] for c in configs}
    threads_before = torch.get_num_threads()
    try:
        for rep in range(args.repeats):
            for c in configs if rep % 2 == 0 else configs[::-1]:
                rec, toks = run_once(model, c, reqs, args)
                runs[c["key"]].append(rec)
                tokens[c["key"]].append(toks)
                cpu_wall = rounded(rec["rank_cpu_per_wall"])
                print(
                    f"repeat {rep + 1}/{args.repeats} {c['key']}: {rec['output_tok_s']:.1f} out tok/s,"
                    f" {rec['wall_s']:.2f} s, {rec['ms_per_step']:.1f} ms/step, attention"
                    f" {rec['attention_backend']}, rank CPU/wall {cpu_wall}",
                    flush=True,
                )
    finally:
        torch.set_num_threads(threads_before)
    return runs, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    t_start = time.perf_counter()
    args.device = resolve_device(args.device)
    cpu = not args.device.startswith("cuda")
    configs, skipped = runnable(configurations(args.tp_sizes, args.cores, cpu), args.device)
    report: dict[str, Any] = {
        "benchmark": "offline throughput with the model split over 1 vs 2 processes (tensor parallelism)",
        "machine": machine_info(device=args.device, cuda=None if cpu else torch.cuda.get_device_name()),
    }
    with common.model_folder(args) as model:
        args.vocab_size = common.model_vocab_size(model)
        shape, params = model_shape(model), model_params(model)
        reqs = offline.build_workload(
            args.num_requests, tuple(args.input_range), tuple(args.output_range), 0.0, 0,
            args.vocab_size, args.seed,
        )  # fmt: skip
        args.engine_args = offline.engine_args(reqs, args.max_running_requests, args.page_size)
        runs, tokens = measure(model, configs, reqs, args)
    reference = next((tokens[c["key"]][0] for c in configs if c["tp_size"] == 1), None)
    results = {}
    for c in configs:
        same = [None if reference is None else t == reference for t in tokens[c["key"]]]
        results[c["key"]] = summarize(c, runs[c["key"]], same)
    split = [results[c["key"]]["same_tokens_as_tp1"] for c in configs if c["tp_size"] > 1]
    speed = ratios(results, configs, args.cores)
    report["config"] = {
        "model": common.model_description(args),
        "model_shape": shape,
        "model_params": params,
        "smoke": args.smoke,
        "seed": args.seed,
        "device": args.device,
        "torch": torch.__version__,
        "cores": args.cores,
        "tp_sizes": args.tp_sizes,
        "repeats": args.repeats,
        "order": "configurations in order, then reversed, alternating per repeat; a fresh engine per run",
        "configurations": configs,
        "threads_per_rank": {c["key"]: c["threads_per_rank"] for c in configs},
        "skipped": skipped,
        "workload": offline.workload_summary(reqs),
        "engine_args": {**args.engine_args, "attention_backend": args.attention_backend},
        "sampling": "greedy (temperature 0), ignore_eos, max_new_tokens = output length",
        "warm_up": "one untimed generate (2 short prompts, 4 tokens) on each engine before its timed run",
    }
    report["results"] = results
    report["speedup"] = speed
    report["same_tokens"] = all(split) if split and None not in split else None
    report["note"] = make_note(args.cores, cpu, results, speed)
    return common.finish_report(report, t_start)


def model_shape(model: Path) -> dict:
    import json

    cfg = json.loads((model / "config.json").read_text())
    keys = (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "dtype", "torch_dtype",
    )  # fmt: skip
    return {k: cfg[k] for k in keys if k in cfg}


def model_params(model: Path) -> int:
    """Parameters in the checkpoint's safetensors files (read from their headers)."""
    import json
    import math

    total = 0
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path, png_path = common.write_outputs(args.out, NAME, report, lambda p: plot(report, p))
    for key, r in report["results"].items():
        print(
            f"{key}: median {r['output_tok_s']:.1f} out tok/s, {r['total_tok_s']:.1f} total tok/s"
            f" (repeats {[round(x, 1) for x in r['repeats_output_tok_s']]})"
        )
    print("speedup:", {k: round(v["output_tok_s_ratio"], 2) for k, v in report["speedup"].items()})
    print(f"same tokens as tp=1: {report['same_tokens']}")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
