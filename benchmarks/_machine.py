"""What machine a benchmark ran on: one helper for every script in benchmarks/."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys


def machine_info(**extra: object) -> dict:
    import numpy as np
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, object] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info.update(extra)
    return info
