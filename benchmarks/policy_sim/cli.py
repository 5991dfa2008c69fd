"""The simulation's flags."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import _common as common


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    # --help opens with the first paragraph of the package's docstring (the benchmark's documentation)
    summary = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
    ap = argparse.ArgumentParser(description=summary)
    ap.add_argument("--quick", action="store_true", help="smaller poisson sweep (smoke test)")
    ap.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)
