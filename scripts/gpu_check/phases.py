"""The two phases, each one device command: their steps, most telling first, with the limit of each.

phase 1, does it work: the carried wheels installed, versions and the GPU, a probe (a flashinfer op
in a CUDA graph), the JIT modules the engine and tests use compiled in parallel, then tests/gpu in
three pytest processes (kernels, sampling, engines).

phase 2, how fast: installed and looked at again (a device command may start on a fresh machine),
the benchmark's JIT modules, then ``benchmarks/gpu --preset check``, which rewrites its JSON after
every stage and draws its PNG at the end. ``--arch qwen3_moe``: the same on the MoE model, its
decode stages only (a second device command).

A rehearsal runs the same steps on this machine's Python with the tiny model: what needs CUDA
reports "skipped: no CUDA", the rest runs as it would there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from . import jit
from .env import WHEEL_DIR, install_argv, source_link, step_env
from .groups import GROUPS
from .runner import Phase

MOE_STAGES = "bandwidth,decode_graphs,decode_eager"  # phase2 --arch qwen3_moe: what it measures
BUDGET_S = 540.0  # one device command may run 600 s; the rest is margin for its start and return
# The figures a later GPU session reads first (issue 41), copied from the benchmark's JSON into the
# phase summary.
HEADLINE = (
    "device", "partial", "decode_ms_bs1", "decode_gpu_ms_bs1", "decode_ms_bs8", "decode_gpu_ms_bs8",
    "decode_ms_bs64", "decode_gpu_ms_bs64", "decode_ms_bs1_eager", "decode_ms_bs8_eager",
    "decode_ms_bs64_eager", "floor_ms_bs1", "kernels_per_decode_step", "num_layers", "offline_tok_s",
    "hf_tok_s", "overlap_speedup",
)  # fmt: skip


def start(name: str, repo: Path, out: Path, rehearse: bool, budget_s: float) -> Phase:
    """The phase, after its setup steps: the wheels installed (not on a rehearsal, which uses this
    Python's packages) and the versions step, which says whether there is CUDA."""
    phase = Phase(name, out, budget_s, {}, repo, rehearse=rehearse)
    src = source_link(repo, phase.scratch / "src")
    site = None if rehearse else phase.scratch / "site"
    phase.env = step_env(repo, src, site)
    wheels = sorted((repo / WHEEL_DIR).glob("*.whl"))
    if rehearse:
        phase.skip("install", "rehearsal: this Python's packages (the wheels are the GPU machine's)")
    elif not wheels:
        phase.skip("install", f"no wheels in {WHEEL_DIR}/: run scripts/gpu-check prepare, carry {WHEEL_DIR}")
    else:
        assert site is not None
        phase.run("install", install_argv(wheels, site), "setup.log", limit_s=120)
    rec = phase.run("versions", [sys.executable, "-m", "gpu_check.versions"], "setup.log", 90, result=True)
    facts = rec.get("result", {})
    phase.facts["gpu"] = facts.get("gpu")
    phase.cuda = bool(facts.get("gpu", {}).get("cuda_available")) and not rehearse
    return phase


def jit_step(phase: Phase, target: str, limit_s: float) -> None:
    gpu = phase.facts.get("gpu") or {}
    hopper = (gpu.get("capability") or [0])[0] == 9
    phase.facts["jit_modules_planned"] = [m.label() for m in jit.plan(target, hopper)]
    phase.run("jit", [sys.executable, "-m", "gpu_check.jit", target], "jit.log", limit_s, True, True)


def phase1(repo: Path, out: Path, rehearse: bool = False, budget_s: float = BUDGET_S) -> int:
    phase = start("phase1", repo, out, rehearse, budget_s)
    phase.run("probe", [sys.executable, "-m", "gpu_check.probe"], "probe.log", 120, True, True)
    jit_step(phase, "tests", limit_s=330)
    for g in GROUPS:
        phase.run(f"tests-{g.name}", g.argv(), f"tests-{g.name}.log", g.limit_s, cuda_only=True)
    return phase.finish()


def phase2(
    repo: Path, out: Path, rehearse: bool = False, budget_s: float = BUDGET_S, arch: str = "qwen3"
) -> int:
    """``arch`` qwen3_moe: the MoE model's decode stages only (its step time at batch 1, 8, 64)."""
    phase = start("phase2", repo, out, rehearse, budget_s)
    jit_step(phase, "bench", limit_s=300)
    size = ["--smoke"] if rehearse else ["--preset", "check"]
    if arch != "qwen3":
        size += ["--arch", arch, "--stages", MOE_STAGES]
    argv = [sys.executable, "benchmarks/gpu", *size, "--out", str(out)]
    # The benchmark gets what is left: its JSON holds every stage done before a limit stops it.
    rec = phase.run("bench", argv, "bench.log", limit_s=phase.remaining())
    rec["headline"] = headline(out)
    phase.write(partial=True)
    return phase.finish()


def headline(out: Path) -> dict[str, Any]:
    """The benchmark JSON's first figures (None when it wrote none)."""
    found = sorted(out.glob("gpu-*.json"))
    if not found:
        return {}
    report = json.loads(found[0].read_text())
    return {k: report.get(k) for k in HEADLINE} | {"json": found[0].name, "stages": report.get("stages")}
