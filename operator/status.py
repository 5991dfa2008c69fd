"""Status conditions, computed (pure) from what the handlers observed."""

from __future__ import annotations

import datetime

from radixserve.operator.manifests import Obj
from radixserve.operator.validation import Problem


def now_iso() -> str:
    return (
        datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    )


def condition(
    ctype: str, status: bool, reason: str, message: str, generation: int, previous: list[Obj] | None, now: str
) -> Obj:
    """A condition whose lastTransitionTime moves only when its status flips."""
    value = "True" if status else "False"
    old = next((c for c in previous or [] if c.get("type") == ctype), None)
    since = (
        old["lastTransitionTime"]
        if old and old.get("status") == value and old.get("lastTransitionTime")
        else now
    )
    return {
        "type": ctype,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def service_conditions(
    problems: list[Problem],
    shortfall: str | None,
    ready: dict[str, int],
    desired: dict[str, int],
    generation: int,
    previous: list[Obj] | None,
    now: str | None = None,
) -> list[Obj]:
    """Ready / Progressing / Degraded for an InferenceService.

    Invalid specs are Degraded (with the first problem's reason) and never Ready; a GPU
    shortfall is Degraded/InsufficientGPUs while pods wait for capacity.
    """
    now = now or now_iso()
    lagging = sorted(c for c in desired if ready.get(c, 0) < desired[c])
    if problems:
        degraded = (True, problems[0].reason, "; ".join(p.message for p in problems))
    elif shortfall:
        degraded = (True, "InsufficientGPUs", shortfall)
    else:
        degraded = (False, "AsExpected", "")
    if problems:
        progressing = (False, "InvalidSpec", "fix the spec to continue")
    elif lagging:
        progressing = (
            True,
            "RollingOut",
            "waiting for " + ", ".join(f"{c} {ready.get(c, 0)}/{desired[c]}" for c in lagging),
        )
    else:
        progressing = (False, "Complete", "all components are ready")
    is_ready = not problems and not lagging
    ready_cond = (
        is_ready,
        "AllReplicasReady" if is_ready else (degraded[1] if problems else "ReplicasNotReady"),
        "",
    )
    return [
        condition("Ready", *ready_cond, generation, previous, now),
        condition("Progressing", *progressing, generation, previous, now),
        condition("Degraded", *degraded, generation, previous, now),
    ]
