"""The README stays short, and its two set-up commands are what CI runs: the test command is exactly
`.ci/run`'s, and the run command installs exactly what that one installs before it serves."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_README_BYTES = 12_000  # the rest lives in docs/ (tests/repo/test_docs.py builds it)


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def ci_command() -> str:
    lines = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if "pytest" in ln]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_the_readme_test_command():
    test_cmd = next(b for b in bash_blocks() if "pytest" in b)
    ci_lines = (ROOT / ".ci/run").read_text().splitlines()
    assert test_cmd in ci_lines


def test_the_readme_run_command_installs_what_ci_installs():
    run_cmd = next(b for b in bash_blocks() if "radixserve serve" in b)
    run_steps = run_cmd.split(" && ")
    ci_steps = ci_command().split(" && ")
    assert run_steps[-1].startswith(".venv/bin/radixserve serve"), run_cmd
    installs = [s for s in ci_steps if s.startswith(("python3 -m venv", ".venv/bin/pip install"))]
    assert run_steps[:-1] == installs


def test_the_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size < MAX_README_BYTES, f"README.md is {size} bytes: move detail into docs/"
