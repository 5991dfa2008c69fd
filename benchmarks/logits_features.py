"""What logprobs, penalties and structured outputs cost the engine, and what they cost the requests
that do not use them.

One Engine, one workload of free requests (greedy, ignore_eos, fixed lengths), run as:

- ``free``: the free requests alone;
- ``free+logprobs``: the same, each asking for logprobs (5 alternatives) of its output and prompt;
- ``free+penalties``: the same, each with repetition, presence and frequency penalties;
- ``mixed_json``: the free requests plus as many JSON-schema-constrained ones in the same batches;
  reported: the free requests' tokens/s against ``free`` (do they keep their speed?) and all tokens/s.

Runs alternate (free, logprobs, penalties, mixed, free, ...) over ``--rounds`` so machine drift hits
every setting alike. On CPU the overlap loop runs forwards inline for this small model (short steps),
so the constrained requests' lost overlap shows only on a GPU.

    radixserve bench logits_features [--model PATH] [--requests 32] [--rounds 3] [--out DIR]

Writes OUT/logits_features.json (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info

from radixserve import Engine, SamplingParams
from radixserve.common.demo_model import make_demo_model
from radixserve.common.sampling import Constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


def workload(n: int, prompt_len: int, out_len: int) -> tuple[list[list[int]], SamplingParams]:
    prompts = [[(17 * i + 31 * j) % 1900 + 10 for j in range(prompt_len)] for i in range(n)]
    return prompts, SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    steps0 = engine.loop.stats.steps
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t
    tokens = [len(o["token_ids"]) for o in outs]
    return {"wall_s": wall, "tokens": tokens, "steps": engine.loop.stats.steps - steps0}


def measure(model: str, args: argparse.Namespace) -> tuple[dict[str, list[dict]], bool]:
    """Every setting ``args.rounds`` times, alternating; returns the runs and whether the KV pool was
    full again afterwards."""
    prompts, free = workload(args.requests, args.prompt_len, args.output_len)
    n = len(prompts)
    settings = {
        "free": [free] * n,
        "free+logprobs": [replace(free, logprobs=5, prompt_logprobs=5)] * n,
        "free+penalties": [replace(free, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)]
        * n,
    }
    constrained = SamplingParams(
        max_new_tokens=args.output_len * 2,
        temperature=1.0,
        seed=0,
        constraint=Constraint("json_schema", json.dumps(SCHEMA)),
    )
    runs: dict[str, list[dict]] = {k: [] for k in [*settings, "mixed_json"]}
    with Engine(model, max_running_requests=2 * n) as engine:
        # warm-up, the grammar backend included (built on the first constrained request)
        run(engine, prompts[:2], [free, constrained])
        for _ in range(args.rounds):
            for name, params in settings.items():
                runs[name].append(run(engine, prompts, params))
            mixed = run(engine, prompts + prompts, [free] * n + [constrained] * n)
            mixed["free_tokens"] = sum(mixed["tokens"][:n])
            runs["mixed_json"].append(mixed)
            engine.scheduler.kv.cache.evict(engine.scheduler.kv.cache.evictable_size)
        kv_full = engine.scheduler.kv.available() == engine.scheduler.kv.capacity
    return runs, kv_full


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model folder (default: the small demo model)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model, few requests (tests)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.prompt_len, args.output_len, args.rounds = 4, 16, 8, 1
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(
            make_demo_model(Path(tmp) / "m", arch="qwen3", size="tiny" if args.smoke else "small")
        )
        runs, kv_full = measure(model, args)
    results = {}
    for name, rs in runs.items():
        tok_s = [sum(r["tokens"]) / r["wall_s"] for r in rs]
        results[name] = {
            "output_tok_s_median": statistics.median(tok_s),
            "output_tok_s_each": tok_s,
            "wall_s_each": [r["wall_s"] for r in rs],
            "steps_each": [r["steps"] for r in rs],
        }
        if name == "mixed_json":
            results[name]["free_requests_wall_share"] = (
                "the free requests share the batches with constrained ones"
            )
    free_tok_s = results["free"]["output_tok_s_median"]
    report = {
        "benchmark": "logits_features",
        "machine": machine_info(),
        "config": vars(args),
        "results": results,
        "relative_to_free": {k: v["output_tok_s_median"] / free_tok_s for k, v in results.items()},
        "kv_pool_full_after": kv_full,
        "note": "output tokens/s of the whole run (mixed_json: free and constrained tokens together); "
        "CPU, so the overlap the constrained requests give up is not visible here",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logits_features.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["relative_to_free"], indent=1))
    print(f"wrote {out / 'logits_features.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
