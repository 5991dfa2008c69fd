"""The operator's own settings, read once from the environment (the chart sets them)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from radixserve.operator.netpol import PolicySettings
from radixserve.operator.objects import Obj
from radixserve.operator.redis_acl import ChartRedis
from radixserve.operator.templates import template_problems

POD_DEFAULTS_ENV = "RADIXSERVE_OPERATOR_POD_DEFAULTS"


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    # The image InferenceServices run when their spec names none: the chart passes its own.
    default_image: str = "ghcr.io/radixserve/radixserve:latest"
    # redis:// URL of the chart-managed Redis (no credentials), for InferenceServices with
    # redis.mode=chart.
    chart_redis_url: str = ""
    # The chart Redis's admin user (the chart's Secret, through a secretKeyRef in the operator's
    # pod): with a password, every chart-mode InferenceService gets its own Redis user (redis_acl).
    # Without one (a Redis without ACLs) they share chart_redis_url.
    redis_admin_user: str = "admin"
    redis_admin_password: str = field(default="", repr=False)
    # A CA file (PEM) the operator's own Redis connections trust: added to a rediss:// URL without
    # ssl_ca_certs (the chart's redisCA value mounts it).
    redis_ca_file: str = ""
    # How often every InferenceService is re-reconciled (status, autoscaling, a pool that
    # appeared) and every GPUNodePool recounted. Handlers are idempotent, so this is only load.
    resync_interval_s: float = 15.0
    pool_interval_s: float = 30.0
    # NetworkPolicies for every InferenceService (a spec's networkPolicy.enabled overrides).
    policies: PolicySettings = field(default_factory=PolicySettings)
    # A pod template ({metadata: {labels, annotations}, spec: {imagePullSecrets, nodeSelector, ...}})
    # merged into every pod of every InferenceService, under the spec's own templates (templates.py).
    pod_defaults: Obj = field(default_factory=dict)

    @property
    def chart_redis(self) -> ChartRedis | None:
        """The chart's Redis with its admin credentials; None without a URL or a password."""
        if not (self.chart_redis_url and self.redis_admin_password):
            return None
        return ChartRedis(self.chart_redis_url, self.redis_admin_user, self.redis_admin_password)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorConfig:
        env = dict(os.environ) if env is None else env
        d = cls()
        redis_peer = env.get("RADIXSERVE_OPERATOR_REDIS_PEER", "")
        policies = PolicySettings(
            enabled=env.get("RADIXSERVE_OPERATOR_NETWORK_POLICY", "").strip().lower() in ("1", "true", "yes"),
            monitoring_namespace=env.get("RADIXSERVE_OPERATOR_MONITORING_NAMESPACE", ""),
            gateway_from=tuple(json.loads(env.get("RADIXSERVE_OPERATOR_GATEWAY_FROM") or "[]")),
            redis_peer=json.loads(redis_peer) if redis_peer else None,
        )
        return cls(
            default_image=env.get("RADIXSERVE_OPERATOR_IMAGE", d.default_image),
            chart_redis_url=env.get("RADIXSERVE_OPERATOR_REDIS_URL", d.chart_redis_url),
            redis_admin_user=env.get("RADIXSERVE_OPERATOR_REDIS_USER") or d.redis_admin_user,
            redis_admin_password=env.get("RADIXSERVE_OPERATOR_REDIS_PASSWORD", ""),
            redis_ca_file=env.get("RADIXSERVE_OPERATOR_REDIS_CA", ""),
            resync_interval_s=float(env.get("RADIXSERVE_OPERATOR_RESYNC_INTERVAL", d.resync_interval_s)),
            pool_interval_s=float(env.get("RADIXSERVE_OPERATOR_POOL_INTERVAL", d.pool_interval_s)),
            policies=policies,
            pod_defaults=pod_defaults(env.get(POD_DEFAULTS_ENV, "")),
        )


def pod_defaults(text: str) -> Obj:
    """The operator's pod template from its JSON; a ValueError naming the variable and the problem
    (the operator then stops at start, saying why, rather than make pods without it)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{POD_DEFAULTS_ENV} is not JSON: {e}") from e
    problems = template_problems(value, POD_DEFAULTS_ENV)
    if problems:
        raise ValueError(f"{POD_DEFAULTS_ENV} is not a pod template: " + "; ".join(problems))
    return dict(value)
