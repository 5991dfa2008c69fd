"""``mypy --strict`` is clean on all of radixserve: ``services/`` and ``operator/`` (the generated
protobuf stubs in ``services/common/pb`` aside). Tests, benchmarks and scripts are not checked: they
are typed where it helps a reader, not held to --strict.

mypy cannot follow the editable install's import hook (``radixserve`` is ``services/`` and
``radixserve.operator`` is ``operator/`` through setuptools' package-dir), so it runs in a folder
whose ``radixserve`` links to what those two hold. Its cache lives on in the temp dir: a cold run
reads torch and transformers (about 40 s), a warm one takes seconds. One run at a time uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # mypy reads torch and transformers cold in about 40 s

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold ``lock`` while mypy writes the shared cache (a no-op where there is no flock)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.mark.timeout(600)
def test_radixserve_passes_mypy_strict(tmp_path: Path) -> None:
    from radixserve.common import protogen

    protogen.ensure()  # the messages' types are the generated .pyi's
    package = tmp_path / "radixserve"
    package.mkdir()
    for entry in (ROOT / "services").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "operator").symlink_to(ROOT / "operator", target_is_directory=True)
    state = Path(tempfile.gettempdir()) / f"radixserve-mypy-{hashlib.sha1(bytes(ROOT)).hexdigest()[:12]}"
    state.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(state / "cache"), "--strict"]
    cmd += ["-p", "radixserve"]
    with _exclusive(state / "lock"):
        proc = subprocess.run(
            cmd,
            cwd=tmp_path,
            env={**os.environ, "MYPYPATH": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=540,
        )
    assert proc.returncode == 0, f"mypy --strict (rc {proc.returncode}):\n{proc.stdout}{proc.stderr}"
