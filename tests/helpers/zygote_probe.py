"""``python -m tests.helpers.zygote_probe FD CODE [SLEEP_S]``: what a started process sees of
itself, as JSON on FD; a line on stderr; then it sleeps SLEEP_S and exits with CODE
(tests/integration/test_zygote.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    fd, code = int(sys.argv[1]), int(sys.argv[2])
    report = {
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "probe_env": os.environ.get("PROBE"),
        "parent_pid_env": os.environ.get("RADIXSERVE_PARENT_PID"),
        "session_leader": os.getsid(0) == os.getpid(),
        "fds": sorted(int(x) for x in os.listdir("/proc/self/fd")),
        "comm": Path("/proc/self/comm").read_text().strip(),
        "random": __import__("numpy").random.random() if "numpy" in sys.modules else None,
    }
    with os.fdopen(fd, "w") as out:
        json.dump(report, out)
    print("probe: said its piece", file=sys.stderr, flush=True)
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
    sys.exit(code)


if __name__ == "__main__":
    main()
