"""The simulation's flags."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import _common as common


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    # --help opens with the first paragraph of the package's docstring (the benchmark's documentation)
    summary = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
    ap = argparse.ArgumentParser(description=summary)
    common.add_run_args(ap, quick_help="smaller poisson sweep (smoke test)")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)
