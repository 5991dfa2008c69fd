"""``python benchmarks/gpu [flags]``: the same run as ``radixserve bench gpu [flags]``."""

import sys
from pathlib import Path

# Python put this folder first on sys.path, where its modules (plot.py, ...) would shadow top-level
# ones; the package is imported from benchmarks/ instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])
from gpu import main  # noqa: E402

raise SystemExit(main())
