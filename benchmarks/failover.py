"""Continuation TTFT after a scheduler dies mid-stream (issue 44): the time from its SIGKILL to the next
token of each stream it was serving, continued on the other pod, with the prompts' prefixes already
held by that pod and without.

Workload: ``--streams`` greedy streams of ``--output-len`` tokens (EOS ignored), prompts of
``--prompt-len`` random token ids (no two share a first block), on 2 scheduler pods with round-robin
routing: sent in order 20 ms apart, so even streams are on pod 0, the victim. Once each has its first
token and ``--kill-delay`` more seconds have passed, pod 0 is SIGKILLed; the gateway continues its
streams on pod 1 from the tokens their clients have (prompt + delivered tokens prefilled there).

Configurations, each ``--repeats`` times on a fresh ``launcher.build_cluster`` (the figures pool them):

- ``prefix on the survivor``: every prompt was sent to both pods before (a 1-token request each,
  round-robin), so the survivor's radix cache holds it and only the delivered tokens are prefilled;
- ``no prefix``: the survivor has never seen the victim's prompts: prompt and output are prefilled.

Reported per configuration: continuation TTFT p50 / p90 / max over the moved streams (death -> next
non-empty chunk after the stall: chunks already on their way from the dead pod come before it), the
survivor's own streams' pause the same way (no decode step runs while it prefills the moved ones),
failed streams, and the gateway's failover counters (``scheduler/moved`` = the victim's streams).

    .venv/bin/python benchmarks/failover.py [--quick] [--out DIR] [--streams N] ...

Writes DIR/failover.json and DIR/failover.png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts here share benchmarks/_*.py
import _common as common
from _common import MODEL_NAME, SPECIAL_IDS
from _machine import machine_info

CONFIGS = ("prefix on the survivor", "no prefix")

FULL, QUICK = common.presets(
    (  # (setting, full run, --quick)
        ("model_size", "tiny", "tiny"),
        ("streams", 8, 8),
        ("prompt_len", 1024, 256),
        ("output_len", 1000, 1500),  # still streaming at the kill; prompt + output within 2,048
        ("kill_delay", 0.2, 0.5),
        ("repeats", 3, 1),
    )
)


def build_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [SPECIAL_IDS + (i % (vocab - SPECIAL_IDS))]  # a first token of its own: no shared block
        + [rng.randrange(SPECIAL_IDS, vocab) for _ in range(length - 1)]
        for i in range(n)
    ]


async def run_streams(url: str, prompts: list[list[int]], output_len: int, kill: Any, delay: float) -> tuple:
    reqs = [{"input_ids": p, "output_len": output_len, "arrival": 0.0} for p in prompts]
    async with common.http_client(len(reqs), 600) as client:
        tasks, firsts = [], []
        for r in reqs:  # in order, 20 ms apart: round-robin puts stream k on pod k % 2
            firsts.append(asyncio.Event())
            stream = common.stream_completion(client, url, r, time.perf_counter(), firsts[-1])
            tasks.append(asyncio.create_task(stream))
            await asyncio.sleep(0.02)
        for f in firsts:
            await f.wait()
        await asyncio.sleep(delay)
        killed_at = time.perf_counter()
        kill()
        streams = await asyncio.gather(*tasks)
    return killed_at, streams


def run_once(model: Path, config: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple:
    """One fresh cluster, one kill: (the kill's time, the streams, the gateway's failover counters)."""
    import httpx

    from radixserve.launcher import build_cluster, free_port

    cluster = build_cluster(
        model,
        MODEL_NAME,
        port=free_port(),
        schedulers=2,
        gateway_args=["--router", "round-robin"],
        torch_threads=args.threads,
    )
    cluster.start()
    try:
        if config == "prefix on the survivor":
            body = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0}
            with httpx.Client(base_url=cluster.url, timeout=300) as h:
                for p in prompts:
                    for _ in range(2):  # round-robin: once on each pod
                        assert h.post("/v1/completions", json={**body, "prompt": p}).status_code == 200
        victim = cluster.schedulers[0]
        killed_at, streams = asyncio.run(
            run_streams(
                cluster.url,
                prompts,
                args.output_len,
                lambda: victim.proc.send_signal(signal.SIGKILL),
                args.kill_delay,
            )
        )
        moved = failovers(cluster.url)
    finally:
        cluster.stop(drain_timeout=2)
    return killed_at, streams, moved


def failovers(url: str) -> dict[str, float]:
    """The gateway's radixserve_stream_failovers counters, as ``cause/outcome``: count."""
    from radixserve.launcher import counter_by

    return counter_by(f"{url}/metrics", "radixserve_stream_failovers", "cause", "outcome")


def resumed(s: common.Stream, killed_at: float) -> float | None:
    """How long after the kill the stream's chunks resumed: the chunk after the largest pause that
    follows the kill counts (chunks already on their way from the dead pod come before the pause).
    None: no chunk came after the kill."""
    after = [killed_at, *(t for t in s.times if t > killed_at)]
    if len(after) == 1:
        return None
    k = max(range(1, len(after)), key=lambda i: after[i] - after[i - 1])
    return after[k] - killed_at


def summarize(runs: list[tuple], output_len: int) -> dict:
    """The runs' moved streams (even ones, on the victim) and the survivor's own, pooled."""
    on_victim, on_survivor, delivered, streams, moved = [], [], [], [], 0.0
    for killed_at, ss, counters in runs:
        on_victim += [g for s in ss[0::2] if (g := resumed(s, killed_at)) is not None]
        # the survivor's own streams pause too while it prefills the moved ones (no decode step then)
        on_survivor += [g for s in ss[1::2] if (g := resumed(s, killed_at)) is not None]
        delivered += [
            sum(t <= killed_at for t in s.times) for s in ss[0::2] if s.times and s.times[-1] > killed_at
        ]
        streams += ss
        moved += counters.get("scheduler/moved", 0.0)
    ok = [s for s in streams if s.error is None and s.usage and s.usage["completion_tokens"] == output_len]
    return {
        "runs": len(runs),
        "streams": len(streams),
        "ok": len(ok),
        "failed": len(streams) - len(ok),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "moved": moved,  # the gateway's count: the victim's streams still running at the kill
        "delivered_tokens_at_kill_p50": common.percentile(delivered, 50),
        **common.ms_percentiles("continuation_ttft", on_victim, (50, 90)),
        "continuation_ttft_ms_max": max(on_victim) * 1000 if on_victim else float("nan"),
        **common.ms_percentiles("survivor_pause", on_survivor, (50, 90)),
    }


def plot(results: dict, path: Path) -> None:
    plt = common.pyplot()
    labels = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [results[k]["continuation_ttft_ms_p50"] for k in labels], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [results[k]["continuation_ttft_ms_p90"] for k in labels], 0.4, label="p90")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("death -> next token (ms)")
    ax.set_title("continuation TTFT after a scheduler SIGKILL")
    ax.legend()
    common.save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_arg(p)
    p.add_argument("--streams", type=int, default=None, help=f"({FULL['streams']}; half on the victim)")
    p.add_argument("--prompt-len", type=int, default=None, help=f"tokens ({FULL['prompt_len']})")
    p.add_argument("--output-len", type=int, default=None, help=f"tokens ({FULL['output_len']})")
    p.add_argument("--kill-delay", type=float, default=None, help="s after the last first token")
    p.add_argument("--repeats", type=int, default=None, help=f"kills per configuration ({FULL['repeats']})")
    p.add_argument("--threads", type=int, default=1, help="torch threads per pod (1)")
    common.add_run_args(p, quick_help="fewer, shorter streams (< 2 min)")
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, QUICK)
    if args.streams < 2 or args.prompt_len < 2 or args.output_len < 2:
        p.error("--streams, --prompt-len and --output-len must be at least 2")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "continuation TTFT after a scheduler SIGKILL",
        "machine": machine_info(),
    }
    with common.model_folder(args) as model:
        vocab = common.model_vocab_size(model)
        results = {}
        for i, config in enumerate(CONFIGS):
            # new prompts per configuration: the first's cannot be in the second's fresh pods anyway
            prompts = build_prompts(args.streams, args.prompt_len, vocab, args.seed + i)
            runs = [run_once(model, config, prompts, args) for _ in range(args.repeats)]
            results[config] = r = summarize(runs, args.output_len)
            print(
                f"{config}: {r['ok']}/{r['streams']} ok, continuation TTFT p50/p90/max"
                f" {r['continuation_ttft_ms_p50']:.0f}/{r['continuation_ttft_ms_p90']:.0f}/"
                f"{r['continuation_ttft_ms_max']:.0f} ms, {r['moved']:.0f} moved",
                flush=True,
            )
    report["config"] = {
        "model": common.model_description(args),
        "quick": args.quick,
        "seed": args.seed,
        "streams": args.streams,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "kill_delay_s": args.kill_delay,
        "repeats": args.repeats,
        "torch_threads_per_pod": args.threads,
    }
    report["results"] = results
    return common.finish_report(report, t_start)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path, png_path = common.write_outputs(
        args.out, "failover", report, lambda p: plot(report["results"], p)
    )
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
