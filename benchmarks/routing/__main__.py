"""``python benchmarks/routing [flags]``: the benchmark run as a folder."""

import sys
from pathlib import Path

# Run as a folder, this file is a top-level script with its own folder first on sys.path, so the
# package's relative imports need the package imported by name: from its parent, benchmarks/.
sys.path[0] = str(Path(__file__).resolve().parents[1])
from routing import main  # noqa: E402  (after the sys.path line above)

raise SystemExit(main())
