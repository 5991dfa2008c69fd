"""The operator's own settings, read once from the environment (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    # The image InferenceServices run when their spec names none: the chart passes its own.
    default_image: str = "ghcr.io/radixserve/radixserve:latest"
    # redis:// URL of the chart-managed Redis, for InferenceServices with redis.mode=chart.
    chart_redis_url: str = ""
    # How often every InferenceService is re-reconciled (status, autoscaling, a pool that
    # appeared) and every GPUNodePool recounted. Handlers are idempotent, so this is only load.
    resync_interval_s: float = 15.0
    pool_interval_s: float = 30.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorConfig:
        env = dict(os.environ) if env is None else env
        d = cls()
        return cls(
            default_image=env.get("RADIXSERVE_OPERATOR_IMAGE", d.default_image),
            chart_redis_url=env.get("RADIXSERVE_OPERATOR_REDIS_URL", d.chart_redis_url),
            resync_interval_s=float(env.get("RADIXSERVE_OPERATOR_RESYNC_INTERVAL", d.resync_interval_s)),
            pool_interval_s=float(env.get("RADIXSERVE_OPERATOR_POOL_INTERVAL", d.pool_interval_s)),
        )
