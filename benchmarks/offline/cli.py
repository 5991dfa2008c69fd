"""The benchmark's flags, with their full-run / ``--quick`` defaults."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import _common as common

FULL, QUICK = common.presets(
    (  # (setting, full run, --quick)
        ("model_size", "small", "tiny"),
        ("num_requests", 64, 12),
        ("input_range", (64, 512), (16, 64)),
        ("output_range", (32, 256), (4, 24)),
        ("shared_prefix_frac", 0.3, 0.5),
        ("prefix_len", 256, 32),
        ("hf_batch_sizes", (16,), (4,)),
        ("max_running_requests", 128, 16),
        ("check_requests", 3, 2),
        ("repeats", 5, 1),
        ("host_bound_pairs", 4, 1),
    )
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    # --help opens with the first paragraph of the package's docstring (the benchmark's documentation)
    summary = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    common.add_model_arg(p)
    p.add_argument("--num-requests", type=int, default=None, help=f"default {FULL['num_requests']}")
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--shared-prefix-frac", type=float, default=None)
    p.add_argument("--prefix-len", type=int, default=None, help="shared system-prompt length")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None, help="each is run; the best is HF")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--check-requests", type=int, default=None, help="requests compared with HF batch-1")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"runs of each system, alternating order; judged on the median ratio ({FULL['repeats']})",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for every system (default 1)"
    )
    p.add_argument(
        "--host-bound-pairs",
        type=int,
        default=None,
        help="normal/overlap pairs on the tiny model, where host work matters; 0: skip"
        f" ({FULL['host_bound_pairs']})",
    )
    p.add_argument("--profile", action="store_true", help="also profile a normal-mode engine run")
    common.add_run_args(p, quick_help="tiny model, few short requests (< 60 s)")
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, QUICK)
    return args
