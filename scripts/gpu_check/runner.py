"""A phase: steps run one after another, each a child process under its own time limit, inside the
phase's budget, each writing its output to a log in the result folder, and the phase's summary
(``<phase>.json``) rewritten after every step, so a phase cut short still returns what it did."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_RESULT_FILES = 8  # what a device command brings back from its result folder
RESERVE_S = 15.0  # kept back from every step for the summary and the tool's own transfer
MIN_STEP_S = 20.0  # a step that would get less is not started
KILL_GRACE_S = 10.0  # between SIGTERM and SIGKILL to a timed-out step's process group


@dataclass
class Phase:
    name: str
    out: Path  # the result folder ($OUT on the device machine)
    budget_s: float  # the whole phase, start to summary
    env: dict[str, str]  # every step's environment
    cwd: Path  # the repository root
    rehearse: bool = False
    cuda: bool = False  # set once the versions step has looked
    min_step_s: float = MIN_STEP_S
    t0: float = field(default_factory=time.monotonic)
    steps: list[dict[str, Any]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # versions, GPU, planned modules, ...
    # the steps' result files, the installed wheels, the source link: outside the result folder,
    # which brings back only a few files; removed at the end
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpu-check-")))

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.write(partial=True)

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def skip(self, name: str, reason: str, **extra: Any) -> dict[str, Any]:
        return self.record({"name": name, "status": f"skipped: {reason}", "seconds": 0.0, **extra})

    def run(
        self,
        name: str,
        argv: Sequence[str],
        log: str,
        limit_s: float,
        cuda_only: bool = False,
        result: bool = False,
    ) -> dict[str, Any]:
        """Run ``argv`` as step ``name``, its output appended to ``log`` in the result folder.
        ``result``: the program takes ``--result PATH`` and leaves a JSON object there (kept in the
        summary). The limit is ``limit_s``, or less if the phase's budget has less left."""
        if cuda_only and not self.cuda:
            return self.skip(name, "no CUDA")
        limit = min(limit_s, self.remaining() - RESERVE_S)
        if limit < self.min_step_s:
            return self.skip(name, f"out of time ({self.remaining():.0f} s of the phase left)")
        argv = list(argv)
        result_path = self.scratch / f"{name}.result.json"
        if result:
            result_path.unlink(missing_ok=True)
            argv += ["--result", str(result_path)]
        rc, seconds = run_logged(argv, self.out / log, limit, self.env, self.cwd, header=name)
        status = (
            "passed" if rc == 0 else f"timed out after {limit:.0f} s" if rc is None else f"failed (exit {rc})"
        )
        rec: dict[str, Any] = {"name": name, "status": status, "seconds": round(seconds, 1)}
        rec |= {"limit_s": round(limit), "log": log, "command": " ".join(argv)}
        if result and result_path.exists():
            rec["result"] = json.loads(result_path.read_text())
            result_path.unlink()
        return self.record(rec)

    def record(self, rec: dict[str, Any]) -> dict[str, Any]:
        self.steps.append(rec)
        print(f"[{self.name}] {rec['name']}: {rec['status']} ({rec['seconds']} s)", flush=True)
        self.write(partial=True)
        return rec

    def finish(self) -> int:
        """The final summary; 0 when every step that ran passed and nothing CUDA-only was skipped
        on a real run."""
        failed = [s["name"] for s in self.steps if not _ok(s["status"], self.rehearse)]
        files = sorted(p.name for p in self.out.iterdir() if p.is_file())
        if len(files) > MAX_RESULT_FILES:
            failed.append(f"result files: {len(files)} > {MAX_RESULT_FILES}")
        self.facts["not_ok"] = failed
        self.write(partial=False)
        shutil.rmtree(self.scratch, ignore_errors=True)
        print(f"[{self.name}] {'ok' if not failed else 'NOT OK: ' + ', '.join(failed)}", flush=True)
        return 1 if failed else 0

    def write(self, partial: bool) -> None:
        summary = {
            "phase": self.name,
            "partial": partial,
            "rehearsal": self.rehearse,
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "budget_s": self.budget_s,
            "cuda": self.cuda,
            **self.facts,
            "steps": self.steps,
        }
        path = self.out / f"{self.name}.json"
        tmp = path.with_name(path.name + ".tmp")  # same folder: the rename below replaces it whole
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(path)


def _ok(status: str, rehearse: bool) -> bool:
    """A step that passed is ok; so is one skipped on a rehearsal (no CUDA there by design)."""
    return status == "passed" or (rehearse and status.startswith("skipped"))


def run_logged(
    argv: Sequence[str], log: Path, limit_s: float, env: dict[str, str], cwd: Path, header: str
) -> tuple[int | None, float]:
    """(exit code, or None when it ran past ``limit_s``; seconds). The child leads its own process
    group, so a timeout ends its children too (ninja's compilers, pytest's engines)."""
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write(f"=== {header}: {' '.join(argv)} (limit {limit_s:.0f} s)\n")
        f.flush()
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = None
            _end_group(proc)
        seconds = time.monotonic() - t0
        f.write(f"=== {header}: {'timed out' if rc is None else f'exit {rc}'} after {seconds:.1f} s\n")
    return rc, seconds


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group, a grace period for its leader, then SIGKILL to whatever is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_GRACE_S)
