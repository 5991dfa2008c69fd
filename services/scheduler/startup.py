"""Where a scheduler's start goes, phase by phase: logged once it serves and exported as
``radixserve_startup_seconds{phase}`` (a cold start is what a request held at zero schedulers waits
for; docs/reliability.md has the figures).

    process_start        exec to the model's resolution: the interpreter, imports, settings
    model_fetch          the model folder made ready (the demo model built; a cluster's init container
                         fetches a store's model before this process starts: its own log says how long)
    engine_setup         the device profile, the tokenizer, tensor-parallel followers started
    weight_load          the checkpoint read into the model's parameters (model/loader.py); with
                         --load-format stream, streamed from its s3:// or gs:// store (the init
                         container's fetch then covers the small files only: model/weight_stream.py)
    kv_allocation        the KV pool and the request tables, sized from the memory left
    graph_capture        CUDA graphs of decode (nothing on CPU)
    kernel_compilation   the first request through the engine: where flashinfer JIT-compiles (or loads
                         from its cache) its prefill and sampling kernels, and torch pays its first uses
    warmup               the remaining warm-up requests (every sampling path)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge

from radixserve.scheduler.metrics import MODEL_LABEL

log = logging.getLogger(__name__)

PHASES = (
    "process_start",
    "model_fetch",
    "engine_setup",
    "weight_load",
    "kv_allocation",
    "graph_capture",
    "kernel_compilation",
    "warmup",
)


def process_age_s() -> float:
    """Seconds since this process was created (Linux: /proc; elsewhere 0: unknown)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def report(
    phases: Mapping[str, float], registry: CollectorRegistry | None = None, model_name: str = ""
) -> str:
    """Log the phases (one line, in start order) and set the gauge in ``registry`` (labelled with the
    served model's name, as every scheduler series is); returns the line."""
    known = {p: phases[p] for p in PHASES if p in phases}
    line = f"started in {sum(known.values()):.2f} s: " + ", ".join(f"{p} {s:.2f} s" for p, s in known.items())
    log.info(line)
    if registry is not None:
        gauge = Gauge(
            "radixserve_startup_seconds", "Seconds each phase of this scheduler's start took",
            [MODEL_LABEL, "phase"], registry=registry,
        )  # fmt: skip
        for p, s in known.items():
            gauge.labels(model_name, p).set(s)
    return line
