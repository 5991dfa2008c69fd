"""The benchmark's fixed settings: the two systems, the targets and the full / ``--quick`` presets."""

from __future__ import annotations

import _common as common

TARGET_THROUGHPUT_RATIO = 0.9  # served output tok/s at saturation >= 0.9x in-process
TARGET_ITL_ADDED_MS = 2.0  # served median ITL - in-process median ITL <= 2 ms
SYSTEMS = ("served", "inprocess")

FULL, QUICK = common.presets(
    (  # (setting, full run, --quick)
        ("model_size", "small", "tiny"),
        ("num_requests", 32, 8),
        ("rates", ("1", "2", "4", "inf"), ("4", "inf")),
        ("input_range", (64, 256), (16, 48)),
        ("output_range", (32, 128), (4, 16)),
        ("max_running_requests", 128, 16),
        ("concurrency", (1, 8, 32), (4,)),
        ("requests_per_client", 5, 2),
        ("repeats", 3, 1),
    )
)
