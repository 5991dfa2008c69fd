"""The steps' Python environment on the GPU machine: the carried wheels installed into a folder of
their own, and the source tree importable as ``radixserve`` without installing the project.

Installing the project (``pip install -e .``) would run setup.py's stub generator, which needs
grpcio-tools, which that machine lacks; nothing the GPU steps run imports the gRPC stubs. So a folder
holding one link, ``radixserve`` -> ``services/``, goes on PYTHONPATH instead. The repository root
itself never does: its ``operator/`` package would shadow the standard library's ``operator``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

WHEEL_DIR = ".gpu-wheels"  # in the repository root, ignored by git, carried by the device tool


def install_argv(wheels: list[Path], site: Path) -> list[str]:
    """pip, offline, each carried wheel into ``site`` (no dependency resolution: the folder holds
    exactly what the machine lacks)."""
    return [
        sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels),
    ]  # fmt: skip


def source_link(repo: Path, folder: Path) -> Path:
    """``folder/radixserve`` -> ``repo/services`` (made or replaced); returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "radixserve"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(repo / "services", target_is_directory=True)
    return folder


def step_env(repo: Path, src: Path, site: Path | None) -> dict[str, str]:
    """The environment every step runs in: the installed wheels first, then the source link, then
    this script's own package (the step programs), then whatever PYTHONPATH held."""
    paths = [str(p) for p in (site, src, repo / "scripts") if p is not None]
    old = os.environ.get("PYTHONPATH")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    env["PYTHONUNBUFFERED"] = "1"  # a step's log is current when a limit ends it
    return env
