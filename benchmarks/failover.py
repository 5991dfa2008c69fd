"""Continuation TTFT after a scheduler dies mid-stream (issue 44): the time from its SIGKILL to the next
token of each stream it was serving, continued on the other pod, with the prompts' prefixes already
held by that pod and without.

Workload: ``--streams`` greedy streams of ``--output-len`` tokens (EOS ignored), prompts of
``--prompt-len`` random token ids (no two share a first block), on 2 scheduler pods with round-robin
routing: started one at a time, so even streams are on pod 0, the victim. Once each has its first
token and ``--kill-delay`` more seconds have passed, pod 0 is SIGKILLed; the gateway continues its
streams on pod 1 from the tokens their clients have (prompt + delivered tokens prefilled there).

Configurations, each on a fresh ``launcher.build_cluster``:

- ``prefix on the survivor``: every prompt was sent to both pods before (a 1-token request each,
  round-robin), so the survivor's radix cache holds it and only the delivered tokens are prefilled;
- ``no prefix``: the survivor has never seen the victim's prompts: prompt and output are prefilled.

Reported per configuration: continuation TTFT p50 / p90 / max over the moved streams (death -> next
non-empty chunk after the stall: chunks already on their way from the dead pod come before it), the
other pod's streams' figure the same way (they are not moved), failed streams, and the gateway's
failover counters.

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
        ("streams", 16, 8),
        ("prompt_len", 1024, 256),
        ("output_len", 400, 200),
        ("kill_delay", 1.0, 0.5),
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
        tasks = []
        for r in reqs:  # one at a time: round-robin puts stream k on pod k % 2
            first = asyncio.Event()
            tasks.append(
                asyncio.create_task(common.stream_completion(client, url, r, time.perf_counter(), first))
            )
            await first.wait()
        await asyncio.sleep(delay)
        killed_at = time.perf_counter()
        kill()
        streams = await asyncio.gather(*tasks)
    return killed_at, streams


def run_config(model: Path, config: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
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
    return summarize(streams, killed_at, args.output_len, moved)


def failovers(url: str) -> dict[str, float]:
    """The gateway's radixserve_stream_failovers counters, as ``cause/outcome``: count."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        f"{x.labels['cause']}/{x.labels['outcome']}": x.value
        for f in text_string_to_metric_families(text)
        if f.name == "radixserve_stream_failovers"
        for x in f.samples
        if x.name.endswith("_total")
    }


def summarize(streams: list[common.Stream], killed_at: float, output_len: int, moved: dict) -> dict:
    def gap(s: common.Stream) -> float | None:
        # the chunk after the largest pause following the kill: chunks already on their way from the
        # dead pod (through the detokenizer) come before the pause
        after = [killed_at, *(t for t in s.times if t > killed_at)]
        if len(after) == 1:
            return None
        k = max(range(1, len(after)), key=lambda i: after[i] - after[i - 1])
        return after[k] - killed_at

    on_victim = [g for s in streams[0::2] if (g := gap(s)) is not None]
    on_survivor = [g for s in streams[1::2] if (g := gap(s)) is not None]
    ok = [s for s in streams if s.error is None and s.usage and s.usage["completion_tokens"] == output_len]
    return {
        "streams": len(streams),
        "ok": len(ok),
        "failed": len(streams) - len(ok),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        **common.ms_percentiles("continuation_ttft", on_victim, (50, 90)),
        "continuation_ttft_ms_max": max(on_victim) * 1000 if on_victim else float("nan"),
        "survivor_next_token_ms_max": max(on_survivor) * 1000 if on_survivor else float("nan"),
        "failovers": moved,
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
            results[config] = r = run_config(model, config, prompts, args)
            print(
                f"{config}: {r['ok']}/{r['streams']} ok, continuation TTFT p50/p90/max"
                f" {r['continuation_ttft_ms_p50']:.0f}/{r['continuation_ttft_ms_p90']:.0f}/"
                f"{r['continuation_ttft_ms_max']:.0f} ms, failovers {r['failovers']}",
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
