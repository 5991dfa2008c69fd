"""The benchmark's fixed settings: its configurations, targets and the full / ``--quick`` presets.

Router names and routing defaults come from the gateway's own config (``ROUTING_DEFAULTS``,
``ROUTERS``), so the benchmark measures what the gateway would run.
"""

from __future__ import annotations

import math

import _common as common

from radixserve.common.service_config import ROUTERS, ROUTING_DEFAULTS

GATEWAY_ROUTING = ROUTING_DEFAULTS  # the gateway's defaults, as `radixserve serve` starts it
BLOCK_SIZE = GATEWAY_ROUTING.block_size  # the gateway's and schedulers' default --block-size
BASELINE = "round-robin"
CONFIGS = (*ROUTERS, "cache-aware+redis")
POLICY = {name: name for name in ROUTERS}  # each configuration's router
POLICY["cache-aware+redis"] = "cache-aware"
TARGET_HIT_RATIO = 3.8
TARGET_THROUGHPUT_RATIO = 1.9
TARGET_TTFT_P90_DIVISOR = 10.0
TARGET_DECISION_P99_MS = 2.0

# The gateway flags whose defaults the cache-aware configurations run with (reported in the JSON).
GATEWAY_DEFAULT_FLAGS = (
    "block_size",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "recent_ttl",
    "working_set_window",
    "kv_fill",
)

FULL, QUICK = common.presets(
    (  # (setting, full run, --quick)
        ("model_size", "small", "tiny"),
        ("schedulers", 4, 2),
        ("num_requests", 240, 32),
        ("rates", (1.0, 4.0, 6.0, math.inf), (16.0,)),
        ("tenants", 16, 4),
        ("prefix_range", (500, 1000), (96, 160)),
        ("suffix_range", (20, 60), (17, 24)),
        ("output_range", (8, 32), (4, 8)),
        ("kv_prefixes", 5.0, 3.0),
        ("page_size", 16, 16),
        ("max_running_requests", 32, 16),
        ("decision_passes", 3, 2),
        ("saturation_repeats", 3, 1),
    )
)


def gateway_defaults() -> str:
    """The gateway's routing defaults as its command-line flags, e.g. ``--block-size 16 ...``."""
    return " ".join(
        f"--{name.replace('_', '-')} {getattr(GATEWAY_ROUTING, name):g}" for name in GATEWAY_DEFAULT_FLAGS
    )
