"""scripts/gpu-check, here without a GPU: the rehearsal runs both phases' steps on CPU with the tiny
model (what needs CUDA says so), the phase runner keeps its limits, and what the phases name (the test
groups, the JIT modules, the wheels) matches the code they name.

The phases themselves run on a GPU machine (docs/gpu.md).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import jit, wheels  # noqa: E402
from gpu_check.groups import GROUPS  # noqa: E402
from gpu_check.phases import HEADLINE  # noqa: E402
from gpu_check.runner import MAX_RESULT_FILES, Phase  # noqa: E402

CUDA_STEPS = ["probe", "jit", "tests-kernels", "tests-sampling", "tests-engine"]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("rehearsal")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/gpu-check"), "--rehearse", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, time.monotonic() - t0


def steps(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in summary["steps"]}


@pytest.mark.slow
def test_rehearsal_phase1_runs_the_python_steps_and_skips_the_cuda_ones(
    rehearsal: tuple[Path, float],
) -> None:
    out, seconds = rehearsal
    print(f"rehearsal of both phases: {seconds:.1f} s")
    summary = json.loads((out / "phase1/phase1.json").read_text())
    assert summary["partial"] is False and summary["rehearsal"] is True and summary["not_ok"] == []
    got = steps(summary)
    assert got["install"]["status"].startswith("skipped: rehearsal")
    assert got["versions"]["status"] == "passed"
    assert {got[name]["status"] for name in CUDA_STEPS} == {"skipped: no CUDA"}
    facts = got["versions"]["result"]
    assert facts["gpu"] == {"cuda_available": False}
    # radixserve came from the source link, as on the GPU machine (no project install there)
    assert Path(facts["packages"]["radixserve"]["from"]).name == "radixserve"
    assert "site-packages" not in facts["packages"]["radixserve"]["from"]
    assert "prefill fa2 bfloat16 d128" in summary["jit_modules_planned"]
    assert "== versions" in (out / "phase1/setup.log").read_text()
    assert len(list((out / "phase1").iterdir())) <= MAX_RESULT_FILES


@pytest.mark.slow
def test_rehearsal_phase2_runs_the_benchmark_and_keeps_its_figures(rehearsal: tuple[Path, float]) -> None:
    out, _ = rehearsal
    summary = json.loads((out / "phase2/phase2.json").read_text())
    assert summary["partial"] is False and summary["not_ok"] == []
    got = steps(summary)
    assert got["jit"]["status"] == "skipped: no CUDA" and got["bench"]["status"] == "passed"
    assert summary["jit_modules_planned"] == [m.label() for m in jit.plan("bench", hopper=False)]
    report = json.loads((out / "phase2/gpu-cpu.json").read_text())
    assert report["partial"] is False and set(report["stages"].values()) == {"done"}
    for key in HEADLINE:  # what the later GPU session reads first: present, and in the summary too
        assert key in report and got["bench"]["headline"][key] == report[key], key
    for key in ("decode_ms_bs1", "decode_ms_bs8", "decode_ms_bs64", "floor_ms_bs1", "offline_tok_s"):
        assert report[key] > 0, key
    assert report["decode_gpu_ms_bs1"] is None  # CUDA events: none on CPU
    assert (out / "phase2/gpu-cpu.png").stat().st_size > 0
    assert "== stage gpu_trace" in (out / "phase2/bench.log").read_text()
    files = list((out / "phase2").iterdir())
    assert len(files) <= MAX_RESULT_FILES and not [f for f in files if f.suffix == ".tmp"]


def test_a_step_past_its_limit_ends_with_its_children_and_the_summary_says_so(tmp_path: Path) -> None:
    phase = Phase("p", tmp_path / "out", budget_s=60, env=dict(os.environ), cwd=tmp_path, min_step_s=0.5)
    assert json.loads((tmp_path / "out/p.json").read_text())["partial"] is True
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)"
    )
    t0 = time.monotonic()
    rec = phase.run("sleeper", [sys.executable, "-c", code], "sleeper.log", limit_s=2)
    assert rec["status"] == "timed out after 2 s" and time.monotonic() - t0 < 20
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not running(child), "the step's own child outlived the step"
    log = (tmp_path / "out/sleeper.log").read_text()
    assert "started" in log and "timed out" in log
    phase.run("ok", [sys.executable, "-c", "pass"], "ok.log", limit_s=30)
    phase.budget_s = 0  # the budget spent: the next step is not started
    assert phase.run("late", [sys.executable, "-c", "pass"], "ok.log", 30)["status"].startswith(
        "skipped: out"
    )
    assert phase.finish() == 1  # the timed-out step (and the skipped one) are not ok
    summary = json.loads((tmp_path / "out/p.json").read_text())
    assert summary["partial"] is False and summary["not_ok"] == ["sleeper", "late"]
    assert [s["status"] for s in summary["steps"]][1] == "passed"


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_test_groups_name_every_gpu_test_once() -> None:
    found: dict[tuple[str, str], int] = {}
    for path in sorted((ROOT / "tests/gpu").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        found.update({(path.relative_to(ROOT).as_posix(), n): 0 for n in defs})
    for g in GROUPS:
        for file, listed in g.tests.items():
            for name in listed:
                assert (file, name) in found, f"group {g.name}: no {file}::{name}"
                found[(file, name)] += 1
    assert {k for k, n in found.items() if n != 1} == set(), "each test in exactly one group"
    # -k matches substrings of names: no test's name may hold another's
    names = [name for _, name in found]
    assert not [(a, b) for a in names for b in names if a != b and a in b]
    assert sum(g.per_test_s <= g.limit_s for g in GROUPS) == len(GROUPS)


def test_jit_plan_follows_the_attention_backends_choices() -> None:
    from radixserve.scheduler.model.attention import flashinfer_backend

    assert jit.MAX_CUDA_CORE_DECODE_GROUP == flashinfer_backend.MAX_CUDA_CORE_DECODE_GROUP
    bench = [m.label() for m in jit.plan("bench", hopper=True)]
    assert bench == [
        "decode bfloat16 d128",
        "prefill fa2 bfloat16 d128",
        "norm",
        "rope",
        "activation",
        "sampling",
    ]
    tests = [m.label() for m in jit.plan("tests", hopper=False)]
    assert "decode bfloat16 d128" not in tests  # GQA 8 decodes on the prefill kernel (tensor cores)
    assert {"decode float16 d64", "prefill fa2 float16 d64", "prefill fa2 bfloat16 d128"} <= set(tests)
    fa3 = set(m.label() for m in jit.plan("tests", hopper=True)) - set(tests)
    assert fa3 == {"prefill fa3 bfloat16 d64"}  # "auto" on Hopper


def test_ninja_log_gives_each_modules_span(tmp_path: Path) -> None:
    log = tmp_path / ".ninja_log"
    log.write_text(
        "# ninja log v5\n"
        "0\t900\t1\tnorm/norm.cuda.o\tab\n"  # an earlier build's line, superseded below
        "100\t4000\t1\tnorm/norm.cuda.o\tab\n"
        "200\t3000\t1\tnorm/binding.cuda.o\tcd\n"
        "4000\t4500\t1\tnorm/norm.so\tef\n"
        "300\t9000\t1\tsampling/sampling.cuda.o\t12\n"
    )
    spans = jit.ninja_times(log)
    norm = spans["norm"]
    assert (norm.start_s, norm.end_s, norm.objects) == (0.1, 4.5, 3)
    assert norm.compile_s == pytest.approx(3.9 + 2.8 + 0.5)
    assert spans["sampling"].end_s - spans["sampling"].start_s == pytest.approx(8.7)
    assert jit.ninja_times(tmp_path / "missing") == {}


def test_flashinfer_is_one_release_in_the_image_the_extra_and_the_wheels() -> None:
    from packaging.requirements import Requirement

    version = wheels.flashinfer_version(ROOT)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    spec = next(Requirement(r) for r in extra if r.startswith("flashinfer-python"))
    assert spec.specifier.contains(version) and not spec.specifier.contains("0.7.0")
    assert wheels.wanted(ROOT)[0] == f"flashinfer-python=={version}"
    call = json.loads(wheels.phase_call("phase1"))
    assert call == {"command": "python3 scripts/gpu-check phase1", "carry": [".gpu-wheels"], "timeout_s": 600}
    assert "/.gpu-wheels/" in (ROOT / ".gitignore").read_text().split()
