"""KV tiers on multi-turn conversations: the same conversations with the tiers off, a host tier, and
a host tier over a disk tier, in one run on CPU.

* Model: the demo llama (``--size``, "small" by default; ``--quick``: "tiny"); ``--arch qwen3_5``: the
  demo hybrid (Gated DeltaNet + full attention: a prefix resumes from a state snapshot, which stays on
  the device while its KV is on the host, and goes to a host snapshot slot when the device's
  snapshot pool evicts it), with the systems ``off`` and ``host`` (the disk tier does not serve
  hybrids); ``--max-state-snapshots``: its device snapshot slots (the engine's default: a tenth of the
  KV memory, at most four per running request); ``--host-state-snapshots``: the host tier's (the
  engine's default: a tenth of the host tier's memory, taken from its KV; given here, their memory
  is added to the host tier's, so its KV tokens stay those of the run without them).
* Workload: ``--conversations`` conversations of ``--turns`` turns over one ``--system-len``-token
  system prompt. Each turn's prompt is the conversation so far (system prompt, earlier user
  messages and answers) plus a new user message of ``--user-range`` tokens; the answer is
  ``--new-tokens`` greedy tokens. Turns are interleaved: every conversation's turn 1, then every
  turn 2, and so on, in waves of ``--concurrency`` requests (a wave is one ``Engine.generate`` call),
  so between two turns of one conversation every other conversation ran once.
* Memory: the device KV pool holds the system prompt and ``--device-fraction`` (a quarter) of the
  conversations' own tokens at their last turn, so most contexts are evicted between their turns.
  ``host`` holds every conversation; ``host_disk`` holds ``--host-fraction`` of them on the host
  and the rest on a disk tier in a temporary directory.
* Per system: prompt tokens computed (``BatchScheduler.prefill_tokens``), hit tokens by tier (the
  device's, loaded back from the host, read from disk), TTFT p50/p90 (from its wave's start to the
  step that sampled its first token), wall time and prompt + output tokens per second. Greedy
  outputs must equal the tiers-off run's (``outputs_equal``), and every pool must be free after.
  torch runs ``--threads`` threads (1). Each engine is warmed up first (untimed).

    .venv/bin/python benchmarks/kv_tiers.py [--quick] [--out DIR] [flags below]
    radixserve bench kv_tiers [same flags]

Writes DIR/kv_tiers.json and DIR/kv_tiers.png. Nothing is asserted about speed.
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

FULL, QUICK = common.presets(
    [
        ("size", "small", "tiny"),
        ("conversations", 48, 8),
        ("turns", 6, 3),
        ("system_len", 1000, 128),
        ("user_range", (16, 64), (8, 24)),
        ("new_tokens", 32, 8),
        ("concurrency", 8, 4),
    ]
)
SYSTEMS = ("off", "host", "host_disk")
LABELS = {"off": "tiers off", "host": "host tier", "host_disk": "host + disk"}
COLORS = {"off": "#c44e52", "host": "#55a868", "host_disk": "#4c72b0"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    about = (__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(prog="radixserve bench kv_tiers", description=about)
    common.add_run_args(p, "the tiny model and a short workload (smoke run)")
    p.add_argument("--size", choices=("tiny", "small"))
    p.add_argument("--arch", choices=("llama", "qwen3_5"), default="llama", help="the demo model")
    p.add_argument("--max-state-snapshots", type=int, help="qwen3_5: the engine's (default: its own)")
    p.add_argument(
        "--host-state-snapshots",
        type=int,
        help="qwen3_5: the host tier's, beside its KV (default: the engine's)",
    )
    p.add_argument("--conversations", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--system-len", type=int)
    p.add_argument("--user-range", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--device-fraction", type=float, default=0.25, help="of the conversations' own tokens")
    p.add_argument("--host-fraction", type=float, default=0.5, help="host + disk: the host's share")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, help="default: all the model's")
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, QUICK)
    common.check_ranges(p, args, ["user_range"])
    if min(args.conversations, args.turns, args.system_len, args.new_tokens, args.concurrency) < 1:
        p.error("--conversations, --turns, --system-len, --new-tokens and --concurrency must be >= 1")
    if not (0 < args.device_fraction <= 1 and 0 < args.host_fraction <= 1):
        p.error("--device-fraction and --host-fraction must be in (0, 1]")
    hybrid = args.arch != "llama"
    if args.systems is None:
        args.systems = [s for s in SYSTEMS if not (hybrid and s == "host_disk")]
    elif hybrid and "host_disk" in args.systems:
        p.error("--systems host_disk: the disk tier does not serve hybrid models (no recurrent states)")
    if (args.max_state_snapshots is not None or args.host_state_snapshots is not None) and not hybrid:
        p.error("--max-state-snapshots, --host-state-snapshots: only with --arch qwen3_5")
    args.systems = ["off", *(s for s in args.systems if s != "off")]  # off first: the outputs' reference
    return args


class Conversations:
    """The workload's token ids: one system prompt, and each conversation's user messages."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        import numpy as np

        rng = np.random.default_rng(args.seed)
        self.system = common.random_token_ids(rng, vocab, args.system_len)

        def message() -> list[int]:
            return common.random_token_ids(rng, vocab, common.draw_len(rng, tuple(args.user_range)))

        self.users = [[message() for _ in range(args.turns)] for _ in range(args.conversations)]

    def own_tokens_at_end(self, new_tokens: int) -> int:
        """The conversations' tokens beyond the system prompt at their last turn's end."""
        return sum(len(u) + new_tokens for turns in self.users for u in turns)


def sizes(args: argparse.Namespace, convs: Conversations) -> dict[str, int]:
    """Device pool and tier sizes in tokens (whole pages)."""
    page = args.page_size
    own = convs.own_tokens_at_end(args.new_tokens)
    whole = len(convs.system) + own

    def pages(tokens: float) -> int:
        return (int(tokens) // page + 1) * page

    # room for one wave's own work beside the cached quarter: a wave must fit on the device
    wave = args.concurrency * (max(len(u) for t in convs.users for u in t) + args.new_tokens + page)
    return {
        "device_tokens": pages(len(convs.system) + args.device_fraction * own + wave),
        "host_tokens": pages(1.2 * whole),
        "host_tokens_with_disk": pages(args.host_fraction * whole),
        "disk_tokens": pages(1.2 * whole),
    }


def serve(model: Path, convs: Conversations, args: argparse.Namespace, **engine_args: Any) -> dict[str, Any]:
    """Every turn of every conversation on one engine: its figures and its outputs."""
    from radixserve import Engine, SamplingParams
    from radixserve.scheduler.batch import ForwardMode
    from radixserve.scheduler.event_loop import Step

    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    if args.max_state_snapshots is not None:
        engine_args["max_state_snapshots"] = args.max_state_snapshots
    with Engine(
        model, device="cpu", page_size=args.page_size, chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=max(8, args.concurrency), **engine_args,
    ) as engine:  # fmt: skip
        common.warm_engine(engine, common.model_vocab_size(model))
        s, cache = engine.scheduler, engine.scheduler.kv.cache
        base = {"computed": s.prefill_tokens, "host": cache.loaded_tokens, "disk": _disk_read(cache)}
        first: dict[str, float] = {}

        def on_step(step: Step) -> None:
            for pb in step.batches:
                if pb.batch.mode is ForwardMode.EXTEND:
                    for req, idx in zip(pb.batch.reqs, pb.batch.token_index.tolist(), strict=True):
                        if idx == 0:
                            first.setdefault(req.rid, pb.processed)

        history = [list(convs.system) for _ in convs.users]
        outs: list[dict[str, Any]] = []
        ttft: list[float] = []
        t0 = time.perf_counter()
        for turn in range(args.turns):
            order = list(range(len(convs.users)))
            for w in range(0, len(order), args.concurrency):
                wave = order[w : w + args.concurrency]
                prompts = [history[c] + convs.users[c][turn] for c in wave]
                first.clear()
                start = time.perf_counter()
                got = engine.generate(input_ids=prompts, sampling_params=greedy, on_step=on_step)
                ttft += [t - start for t in first.values()]
                for c, prompt, o in zip(wave, prompts, got, strict=True):
                    history[c] = prompt + o["token_ids"]
                outs += got
        wall = time.perf_counter() - t0
        kv = s.kv
        pools_free = kv.available() == kv.capacity and kv.req_to_token.num_free == kv.req_to_token.max_running
        per_token = engine.model_config.kv_bytes_per_token()
        states = engine.runner.states  # a hybrid's StatePool
        snapshots = getattr(cache, "snapshots", None)  # a hybrid's state snapshot slots
        host_snapshots = getattr(cache, "host_snapshots", None)  # ... and the host tier's
        figures = {
            "computed": s.prefill_tokens - base["computed"],
            "host": cache.loaded_tokens - base["host"],
            "disk": _disk_read(cache) - base["disk"],
            "written_to_host": cache.written_back_tokens,
        }
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    lower = figures["host"]  # every token loaded to the device came through the host tier
    return {
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": figures["computed"],
        "hit_tokens": {"device": cached - lower, "host": lower - figures["disk"], "disk": figures["disk"]},
        "hit_rate": cached / prompt_tokens,
        **common.ms_percentiles("ttft", ttft, (50, 90)),
        "wall_s": wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "tokens_written_to_host": figures["written_to_host"],
        "pools_free_after": pools_free,
        "state_snapshots": snapshots.capacity if snapshots is not None else 0,
        "host_state_snapshots": host_snapshots.capacity if host_snapshots is not None else 0,
        "snapshots_to_host": getattr(cache, "stored_snapshots", 0),  # (warm-up's included)
        "snapshots_from_host": getattr(cache, "loaded_snapshots", 0),
        "kv_bytes_per_token": per_token,
        "state_slot_bytes": states.nbytes // states.num_slots if states is not None else 0,
        "outputs": [o["token_ids"] for o in outs],
    }


def _disk_read(cache: Any) -> int:
    """Tokens the disk tier has read back (0 without one)."""
    disk = getattr(cache, "disk", None)
    return int(getattr(disk, "read_tokens", 0)) if disk is not None else 0


def engine_args(system: str, sz: dict[str, int], per_token: int, disk_dir: Path) -> dict[str, Any]:
    gib = 2**30
    device = {"max_total_tokens": sz["device_tokens"]}
    if system == "host":
        return device | {"host_kv_cache_gb": per_token * sz["host_tokens"] / gib}
    return device | {
        "host_kv_cache_gb": sz["host_tokens_with_disk"] * per_token / gib,
        "kv_disk_cache_dir": str(disk_dir),
        "kv_disk_cache_gb": sz["disk_tokens"] * per_token / gib,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from radixserve.common.demo_model import make_demo_model

    torch.set_num_threads(args.threads)  # as bench offline: one thread on a shared 2-core machine
    t_start, machine = time.perf_counter(), machine_info()
    with tempfile.TemporaryDirectory(prefix="radixserve-bench-kv-tiers-") as tmp:
        model = make_demo_model(Path(tmp) / "model", arch=args.arch, size=args.size, seed=0)
        convs = Conversations(args, common.model_vocab_size(model))
        sz = sizes(args, convs)
        results = {"off": serve(model, convs, args, max_total_tokens=sz["device_tokens"])}
        per_token = results["off"]["kv_bytes_per_token"]  # of the KV as served (the CPU's dtype)
        for system in args.systems[1:]:
            disk = Path(tmp) / f"disk-{system}"
            kw = engine_args(system, sz, per_token, disk)
            if args.host_state_snapshots is not None and system == "host":  # beside the same KV
                n = args.host_state_snapshots
                kw["host_kv_cache_gb"] += (n * results["off"]["state_slot_bytes"] + 1) / 2**30
                kw["host_state_snapshots"] = n
            results[system] = serve(model, convs, args, **kw)
    for r in results.values():
        del r["kv_bytes_per_token"], r["state_slot_bytes"]
    reference = results["off"]["outputs"]
    equal = {name: r.pop("outputs") == reference for name, r in results.items()}
    off = results["off"]
    report = {
        "benchmark": "KV tiers: multi-turn conversations with the tiers off, a host tier, host + disk",
        "config": {
            "model": f"demo {args.arch}/{args.size} (built in a temp dir)",
            **{k: getattr(args, k) for k in ("conversations", "turns", "system_len", "new_tokens")},
            "concurrency": args.concurrency,
            "user_range": list(args.user_range),
            "device_fraction": args.device_fraction,
            "host_fraction": args.host_fraction,
            "kv_bytes_per_token": per_token,
            **sz,
            "page_size": args.page_size,
            "max_state_snapshots": args.max_state_snapshots,
            "host_state_snapshots": args.host_state_snapshots,
            "chunked_prefill_size": args.chunked_prefill_size,
            "seed": args.seed,
            "device": "cpu",
            "torch_threads": args.threads,
        },
        "machine": machine,
        "results": results,
        "summary": {
            "outputs_equal": all(equal.values()),
            **{
                f"{name}_vs_off": {
                    "prefill_tokens_fewer": off["prefill_tokens_computed"]
                    / max(1, r["prefill_tokens_computed"]),
                    "ttft_p50_lower": off["ttft_ms_p50"] / r["ttft_ms_p50"],
                    "ttft_p90_lower": off["ttft_ms_p90"] / r["ttft_ms_p90"],
                    "throughput": r["total_tok_s"] / off["total_tok_s"],
                }
                for name, r in results.items()
                if name != "off"
            },
        },
    }
    return common.finish_report(report, t_start)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    res = report["results"]
    names = list(res)
    panels = [
        ("prefill_tokens_computed", "prompt tokens computed", "{:.0f}"),
        ("ttft_ms_p50", "TTFT p50 (ms)", "{:.0f}"),
        ("ttft_ms_p90", "TTFT p90 (ms)", "{:.0f}"),
        ("total_tok_s", "throughput (prompt + output tok/s)", "{:.0f}"),
    ]
    fig, axes = plt.subplots(1, 5, figsize=(18, 4))
    for ax, (key, title, fmt) in zip(axes, panels, strict=False):
        values = [res[n][key] for n in names]
        ax.bar([LABELS[n] for n in names], values, color=[COLORS[n] for n in names])
        for i, v in enumerate(values):
            ax.annotate(fmt.format(v), (i, v), ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, max(values) * 1.25 or 1)
        ax.set_title(title, fontsize=9)
    ax = axes[-1]  # hit tokens by tier, stacked
    bottom = [0.0] * len(names)
    for tier, color in (("device", "#999999"), ("host", "#55a868"), ("disk", "#4c72b0")):
        values = [res[n]["hit_tokens"][tier] for n in names]
        ax.bar([LABELS[n] for n in names], values, bottom=bottom, color=color, label=tier)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylim(0, max(bottom) * 1.25 or 1)
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    ax.set_title("prompt tokens served from each tier", fontsize=9)
    c = report["config"]
    fig.suptitle(
        f"{c['model']}: {c['conversations']} conversations x {c['turns']} turns over a "
        f"{c['system_len']}-token system prompt, device pool {c['device_tokens']} tokens, "
        f"waves of {c['concurrency']}, CPU",
        fontsize=10,
    )
    common.save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path, png_path = common.write_outputs(args.out, "kv_tiers", report, lambda path: plot(report, path))
    for name, x in report["results"].items():
        print(
            f"{name:10s} computed {x['prefill_tokens_computed']:7d} of {x['prompt_tokens']:7d} prompt tokens "
            f"(hits {x['hit_tokens']}), TTFT p50 {x['ttft_ms_p50']:.0f} ms p90 {x['ttft_ms_p90']:.0f} ms, "
            f"{x['total_tok_s']:.0f} tok/s"
        )
    print(f"summary: {report['summary']}")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
