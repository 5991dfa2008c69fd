"""The benchmark's flags: defaults from the full-run / ``--quick`` presets, checked for sense."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import _common as common
from _common import rate_label

from .settings import FULL, QUICK
from .workload import parse_rate


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    # --help opens with the first paragraph of the package's docstring (the benchmark's documentation)
    summary = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(description=summary)
    common.add_model_arg(p)
    p.add_argument("--rates", nargs="+", default=None, help=f"req/s, 'inf' = all at once ({FULL['rates']})")
    p.add_argument("--num-requests", type=int, default=None, help=f"per rate ({FULL['num_requests']})")
    p.add_argument("--input-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help=f"closed-loop clients ({FULL['concurrency']})",
    )
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=None,
        help=f"closed loop: requests each client runs back to back ({FULL['requests_per_client']})",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"closed loop: paired runs per concurrency, the verdict on their median ({FULL['repeats']})",
    )
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads: the scheduler and in-process (1)")
    common.add_run_args(p, quick_help="tiny model, few short requests (< 60 s)")
    args = p.parse_args(argv)
    common.fill_defaults(args, FULL, QUICK)
    args.rates = [parse_rate(str(r)) for r in args.rates]
    if len({rate_label(r) for r in args.rates}) != len(args.rates):
        p.error("--rates has duplicates")
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    args.concurrency = [int(c) for c in args.concurrency]
    if len(set(args.concurrency)) != len(args.concurrency) or min(args.concurrency) < 1:
        p.error("--concurrency: distinct values >= 1")
    if max(args.concurrency) > args.max_running_requests:
        p.error("--concurrency above --max-running-requests: the running batch could not hold C requests")
    if args.requests_per_client < 1:
        p.error("--requests-per-client must be >= 1")
    if not 1 <= args.repeats <= 5:
        p.error("--repeats must be in 1..5")
    common.check_ranges(p, args, ("input_range", "output_range"))
    return args
