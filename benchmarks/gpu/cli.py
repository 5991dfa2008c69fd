"""The benchmark's flags, with their full-run / ``--preset check`` / ``--smoke`` defaults."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import _common as common

from .stages import STAGES

FULL, SMOKE = common.presets(
    (  # (setting, full run, --smoke)
        ("prompt_len", 128, 16),
        ("decode_steps", 64, 6),
        ("profile_steps", 5, 3),
        ("num_requests", 256, 6),
        ("input_range", (100, 1024), (8, 24)),
        ("output_range", (100, 1024), (4, 12)),
        ("hf_batch_sizes", (64,), (3,)),
        ("max_running_requests", 256, 64),
        ("copy_mib", 1024, 32),
        ("threads", None, 1),
    )
)
# What scripts/gpu-check's phase 2 runs: every stage, at sizes that fit one device command with the
# flashinfer JIT build before it (docs/gpu.md): 64 requests, graph buckets up to 64, one HF batch.
CHECK = {
    **FULL,
    "num_requests": 64,
    "input_range": (64, 512),
    "output_range": (64, 256),
    "max_running_requests": 64,
}
PRESETS = {"full": FULL, "check": CHECK}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    # --help opens with the first paragraph of the package's docstring (the benchmark's documentation)
    summary = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    p.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU, tiny counts: end to end in < 1 min"
    )
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default="full", help="sizes: full, or check (scripts/gpu-check)"
    )
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        help=f"comma-separated, run in this order: {','.join(STAGES)} (default all; fewer: a partial report)",
    )
    p.add_argument(
        "--arch",
        choices=("qwen3", "qwen3_moe"),
        default="qwen3",
        help="the model: Qwen3-0.6B's shapes, or them with 64-expert MoE layers (model.py)",
    )
    p.add_argument("--device", default=None, help="cuda (default) or cpu (--smoke's default)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on CPU)")
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="engine default when unset")
    p.add_argument("--prompt-len", type=int, default=None, help=f"decode runs' prompt ({FULL['prompt_len']})")
    p.add_argument(
        "--decode-steps", type=int, default=None, help=f"tokens each decode run ({FULL['decode_steps']})"
    )
    p.add_argument("--profile-steps", type=int, default=None, help="decode steps under the profiler")
    p.add_argument(
        "--num-requests", type=int, default=None, help=f"offline workload ({FULL['num_requests']})"
    )
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None, help="HF static batches; best kept")
    p.add_argument("--max-running-requests", type=int, default=None, help="offline runs' engine limit")
    p.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth tensor size (1024)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (smoke: 1)")
    args = p.parse_args(argv)
    args.quick = args.smoke  # common.fill_defaults' switch
    common.fill_defaults(args, PRESETS[args.preset], SMOKE)
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown or not args.stages:
        p.error(f"--stages: {unknown or 'none'}; choose from {','.join(STAGES)}")
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    common.check_ranges(p, args, ["input_range", "output_range"])
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device here: run on a GPU machine, or pass --smoke (CPU)")
    return args
