"""The benchmark's flags: defaults from the full-run / ``--quick`` presets, the configurations to run."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence

import _common as common
from _common import rate_label

from .settings import BASELINE, CONFIGS, FULL, QUICK


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    # --help opens with the first paragraph of the package's docstring (the benchmark's documentation)
    summary = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    common.add_model_arg(p)
    p.add_argument("--schedulers", type=int, default=None, help=f"scheduler pods ({FULL['schedulers']})")
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="Poisson arrival rates to sweep, req/s; inf: all at t=0"
        f" ({' '.join(map(rate_label, FULL['rates']))})",
    )
    p.add_argument("--num-requests", type=int, default=None, help=f"({FULL['num_requests']})")
    p.add_argument("--tenants", type=int, default=None, help=f"distinct system prompts ({FULL['tenants']})")
    p.add_argument("--prefix-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--suffix-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument(
        "--kv-prefixes",
        type=float,
        default=None,
        help=f"per-pod KV capacity in mean-length tenant prefixes ({FULL['kv_prefixes']})",
    )
    p.add_argument(
        "--max-total-tokens", type=int, default=None, help="per-pod KV tokens (overrides --kv-prefixes)"
    )
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads per scheduler (1)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="another scheduler engine argument, e.g. chunked_prefill_size=512 (repeatable)",
    )
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=None, help="subset to run (all)")
    p.add_argument("--redis-server", default=None, help="redis-server binary (default: from PATH)")
    p.add_argument("--decision-passes", type=int, default=None, help="replays of the decisions per config")
    p.add_argument(
        "--saturation-repeats",
        type=int,
        default=None,
        help="runs of the highest rate (round-robin and cache-aware configs), each a paired throughput"
        f" ratio, judged on the median ({FULL['saturation_repeats']})",
    )
    common.add_run_args(p, quick_help="tiny model, 2 pods, few requests (< 90 s)")
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, QUICK)
    if args.num_requests < 1 or args.schedulers < 1 or args.tenants < 1 or not all(r > 0 for r in args.rates):
        p.error("--num-requests, --schedulers, --tenants and --rates must be positive")
    args.rates = sorted(set(args.rates))
    if any("=" not in kv for kv in args.engine_arg):
        p.error("--engine-arg takes NAME=VALUE")
    common.check_ranges(p, args, ("prefix_range", "suffix_range", "output_range"))
    args.configs = list(args.configs or CONFIGS)
    if BASELINE not in args.configs:
        args.configs.append(BASELINE)
    args.redis_server = args.redis_server or shutil.which("redis-server")
    args.skipped = {}
    if "cache-aware+redis" in args.configs and not args.redis_server:
        args.configs.remove("cache-aware+redis")
        args.skipped["cache-aware+redis"] = "no redis-server binary"
    args.configs = [c for c in CONFIGS if c in args.configs]  # a fixed order
    return args
