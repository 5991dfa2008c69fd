"""`radixserve serve`'s start and restarts, with its zygote and without (``RADIXSERVE_ZYGOTE=0``):
how long a local cluster (one scheduler, a gateway, a detokenizer; the tiny demo model) takes to be
ready, the first time and again in the same launcher, and how long a scheduler killed outright takes
to be routed to again under supervision. Each setting runs in its own process, so the first start
with the zygote includes the zygote's own imports.

    radixserve bench local_start [--quick] [--restarts 5] [--out DIR]

Writes OUT/local_start.json and OUT/local_start.png. No target: the figures are docs/serving.md's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info

from radixserve.common.zygote import ForkedProcess
from radixserve.launcher import Cluster, RestartPolicy, Service, build_cluster, free_port

SETTINGS = {"zygote": "1", "exec": "0"}  # RADIXSERVE_ZYGOTE


def _ready_s(cluster: Cluster) -> dict[str, float]:
    """Starts the cluster; each service's seconds to healthy, and the whole's (routes included)."""
    t0 = time.monotonic()
    for s in cluster.services:
        s.start()
    ready: dict[str, float] = {}
    while len(ready) < len(cluster.services) or cluster.gateway_connected() != len(cluster.schedulers):
        for s in cluster.services:
            if s.name not in ready and s.healthy():
                ready[s.name] = round(time.monotonic() - t0, 3)
        assert all(s.alive() for s in cluster.services), "a service exited during its start"
        assert time.monotonic() - t0 < 300, "not ready in 300 s"
        time.sleep(0.02)
    return {**ready, "cluster": round(time.monotonic() - t0, 3)}


def _restart_s(cluster: Cluster, s: Service) -> float:
    """SIGKILLs ``s``; seconds until the supervisor's new process serves and the gateway routes to it."""
    old = s.proc
    assert old is not None
    t0 = time.monotonic()
    old.send_signal(signal.SIGKILL)
    while s.proc is old or not s.healthy() or cluster.gateway_connected() != len(cluster.schedulers):
        assert time.monotonic() - t0 < 300, "not back in 300 s"
        time.sleep(0.02)
    return round(time.monotonic() - t0, 3)


def run_setting(model: Path, restarts: int) -> dict[str, object]:
    """One setting, in this process (its environment says which): two starts, then restarts."""
    starts = []
    for _ in range(2):
        cluster = build_cluster(model, "bench", port=free_port(), schedulers=1, torch_threads=1)
        starts.append(_ready_s(cluster))
        cluster.stop(drain_timeout=2)
    cluster = build_cluster(model, "bench", port=free_port(), schedulers=1, torch_threads=1)
    cluster.start()
    # every kill restarted at once: none counts as a crash soon after its start (no backoff, no giving up)
    cluster.supervise(RestartPolicy(fast_crash_s=0.0), say=lambda _line: None)
    try:
        again = [_restart_s(cluster, cluster.schedulers[0]) for _ in range(restarts)]
        forked = [isinstance(s.proc, ForkedProcess) for s in cluster.services]
    finally:
        cluster.stop(drain_timeout=2)
    return {
        "first_start": starts[0],
        "second_start": starts[1],
        "scheduler_restarts_s": again,
        "services_forked": sum(forked),
        "services": len(forked),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 restarts per setting (the tests' run)")
    p.add_argument("--restarts", type=int, default=None, help="scheduler restarts per setting (default 5)")
    p.add_argument("--model", type=Path, help="HF model folder (default: the tiny demo model)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "local_start")
    p.add_argument("--one-setting", action="store_true", help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args(argv)
    restarts = args.restarts or (2 if args.quick else 5)
    if restarts < 1:
        p.error(f"--restarts {restarts}: expected at least 1")
    if args.one_setting:
        print(json.dumps(run_setting(args.model, restarts)), flush=True)
        return 0

    tmp = tempfile.TemporaryDirectory()
    if args.model is None:
        from radixserve.common.demo_model import make_demo_model

        args.model = make_demo_model(Path(tmp.name) / "model", arch="llama", size="tiny")
    results = {}
    for name, flag in SETTINGS.items():
        one = ["--one-setting", "--model", str(args.model), "--restarts", str(restarts)]
        done = subprocess.run(
            [sys.executable, __file__, *one],
            env={**os.environ, "RADIXSERVE_ZYGOTE": flag},
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"the {name} run failed (exit code {done.returncode})")
        out = done.stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
        r = results[name]
        print(
            f"{name:6}: first start {r['first_start']['cluster']:.2f} s,"
            f" again {r['second_start']['cluster']:.2f} s, scheduler restarts {r['scheduler_restarts_s']} s",
            flush=True,
        )
    report = {
        "benchmark": "radixserve serve: local cluster start and scheduler restart, zygote vs exec",
        "config": {"model": str(args.model), "restarts": restarts, "quick": args.quick},
        "machine": machine_info(),
        "results": results,
        "median_restart_s": {k: statistics.median(v["scheduler_restarts_s"]) for k, v in results.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "local_start.json").write_text(json.dumps(report, indent=1))
    _plot(report, args.out / "local_start.png")
    return 0


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    labels = ["first start", "second start", "scheduler restart (median)"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for i, name in enumerate(res):
        r = res[name]
        vals = [
            r["first_start"]["cluster"],
            r["second_start"]["cluster"],
            report["median_restart_s"][name],
        ]
        xs = [x + (i - 0.5) * width for x in range(len(labels))]
        bars = ax.bar(xs, vals, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("seconds to ready")
    ax.set_title("radixserve serve, tiny demo model: zygote vs exec")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
