"""Status conditions, computed (pure) from what the handlers observed."""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import kopf

from radixserve.operator.objects import Obj
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


MESSAGE_LIMIT = 1024  # characters of a scheduler's termination message a condition carries


def _terminated_failure(container_status: Obj) -> tuple[int, str] | None:
    """(exit code, message) of the container's current or last run when it failed saying why."""
    if container_status.get("ready"):
        return None  # serving again: an earlier failure is history
    for state in (container_status.get("state"), container_status.get("lastState")):
        done = (state or {}).get("terminated") or {}
        code = int(done.get("exitCode") or 0)
        message = str(done.get("message") or "").strip()
        if code != 0 and message:
            return code, message
    return None


def scheduler_failure(pods: list[Obj]) -> str | None:
    """Why the scheduler pods fail, from their containers' termination messages (None: they do not).

    A scheduler that cannot serve its model (``--tp-size`` not dividing the model's heads, say) exits
    non-zero after writing one line to /dev/termination-log; with ``FallbackToLogsOnError`` a crash
    that wrote nothing leaves its last log lines. The first failing pod (by name) speaks for all;
    a long message keeps its end, where a traceback's error is.
    """
    failed: list[tuple[str, str, int, str]] = []
    for pod in sorted(pods, key=lambda p: str(p.get("metadata", {}).get("name", ""))):
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        st = pod.get("status") or {}
        for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
            found = _terminated_failure(cs)
            if found:
                failed.append((pod["metadata"].get("name", "?"), str(cs.get("name", "?")), *found))
                break
    if not failed:
        return None
    pod_name, container, code, message = failed[0]
    if len(message) > MESSAGE_LIMIT:
        message = "..." + message[-(MESSAGE_LIMIT - 3) :]
    more = f" ({len(failed)} scheduler pods are failing)" if len(failed) > 1 else ""
    return f"pod {pod_name} container {container} exited with code {code}{more}: {message}"


# What a pod's own status says is wrong, most specific first: a pod that cannot be placed, an image that
# cannot be pulled, a container killed for memory, one that keeps crashing.
_WAITING = {"ImagePullBackOff": "ImagePullBackOff", "ErrImagePull": "ImagePullBackOff"}


def pod_trouble(pods: list[Obj]) -> tuple[str, str] | None:
    """(reason, message) for the first pod (by name) that Kubernetes reports in trouble: Unschedulable
    (with the scheduler's message), ImagePullBackOff, OOMKilled or CrashLoopBackOff; None when none is.
    A pod being deleted, or ready, is not in trouble."""
    found: list[tuple[int, str, str, str]] = []  # (rank, pod, reason, message)
    for pod in pods:
        meta, st = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = str(meta.get("name", "?"))
        for cond in st.get("conditions") or []:
            unplaced = cond.get("type") == "PodScheduled" and cond.get("status") == "False"
            if unplaced and cond.get("reason") == "Unschedulable":
                found.append((0, name, "Unschedulable", str(cond.get("message") or "")))
        for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
            if cs.get("ready"):
                continue
            waiting = (cs.get("state") or {}).get("waiting") or {}
            last = (cs.get("lastState") or {}).get("terminated") or {}
            container = str(cs.get("name", "?"))
            if waiting.get("reason") in _WAITING:
                why = waiting.get("message") or waiting["reason"]
                msg = f"container {container} ({cs.get('image', '?')}): {why}"
                found.append((1, name, _WAITING[waiting["reason"]], msg))
            elif last.get("reason") == "OOMKilled":
                found.append(
                    (2, name, "OOMKilled", f"container {container} was killed for using too much memory")
                )
            elif waiting.get("reason") == "CrashLoopBackOff":
                code = last.get("exitCode")
                msg = f"container {container} keeps exiting" + (
                    f" (last exit code {code})" if code is not None else ""
                )
                found.append((3, name, "CrashLoopBackOff", msg))
    if not found:
        return None
    _, pod_name, reason, message = min(found)
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    return reason, f"pod {pod_name}: {message}"


def service_conditions(
    problems: list[Problem],
    shortfall: str | None,
    ready: dict[str, int],
    desired: dict[str, int],
    generation: int,
    previous: list[Obj] | None,
    now: str | None = None,
    failure: str | None = None,
    trouble: tuple[str, str] | None = None,
) -> list[Obj]:
    """Ready / Progressing / Degraded for an InferenceService.

    Invalid specs are Degraded (with the first problem's reason) and never Ready; scheduler pods
    that exit saying why (``failure``, from :func:`scheduler_failure`) are Degraded/SchedulerFailed
    with that message; a GPU shortfall is Degraded/InsufficientGPUs while pods wait for capacity;
    otherwise pods Kubernetes reports in trouble (``trouble``, from :func:`pod_trouble`) make it
    Degraded with that reason (Unschedulable, ImagePullBackOff, OOMKilled, CrashLoopBackOff).
    """
    now = now or now_iso()
    lagging = sorted(c for c in desired if ready.get(c, 0) < desired[c])
    if problems:
        degraded = (True, problems[0].reason, "; ".join(p.message for p in problems))
    elif failure:
        degraded = (True, "SchedulerFailed", failure)
    elif shortfall:
        degraded = (True, "InsufficientGPUs", shortfall)
    elif trouble:
        degraded = (True, *trouble)
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
        "AllReplicasReady"
        if is_ready
        else (degraded[1] if problems or failure or trouble else "ReplicasNotReady"),
        "",
    )
    return [
        condition("Ready", *ready_cond, generation, previous, now),
        condition("Progressing", *progressing, generation, previous, now),
        condition("Degraded", *degraded, generation, previous, now),
    ]


def write_status(patch: kopf.Patch, current: Obj, new: Mapping[str, object]) -> None:
    """Patch only what changed: the resync timers then write nothing to a settled object."""
    for key, value in new.items():
        if current.get(key) != value:
            patch.status[key] = value
