"""Compiled kernels a scheduler finds at its start and leaves behind: flashinfer's JIT cache
(``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``, else ``~/.cache/flashinfer``), Triton's
(``$TRITON_CACHE_DIR``) and Inductor's (``$TORCHINDUCTOR_CACHE_DIR``). The operator points them at the
model cache volume, so a second start on a node compiles nothing: the log line says how many built
artefacts (shared objects, cubins) were reused and how many compiled now."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_BUILT = (".so", ".cubin", ".hsaco")  # what a finished build leaves (sources and locks are not counted)


def cache_dirs() -> dict[str, Path]:
    """The compile caches in force, by owner."""
    home = Path.home()
    fi_base = os.environ.get("FLASHINFER_WORKSPACE_BASE")
    return {
        "flashinfer": (Path(fi_base) if fi_base else home) / ".cache" / "flashinfer",
        "triton": Path(os.environ.get("TRITON_CACHE_DIR") or home / ".triton" / "cache"),
        "inductor": Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "/tmp/torchinductor_" + _user()),
    }


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _built(folder: Path) -> set[str]:
    if not folder.is_dir():
        return set()
    return {os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f.endswith(_BUILT)}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The built artefacts in each cache at one moment (take one before the engine starts)."""

    found: dict[str, frozenset[str]]

    @classmethod
    def take(cls) -> Snapshot:
        return cls({owner: frozenset(_built(folder)) for owner, folder in cache_dirs().items()})

    def report(self) -> dict[str, tuple[int, int]]:
        """Log, per cache, the artefacts reused (there before) and compiled since; returns them."""
        out = {}
        for owner, folder in cache_dirs().items():
            before = self.found.get(owner, frozenset())
            now = _built(folder)
            out[owner] = (len(before & now), len(now - before))
        said = ", ".join(f"{o} {r} reused, {c} compiled" for o, (r, c) in out.items())
        log.info("compiled kernels (%s): %s", ", ".join(str(p) for p in cache_dirs().values()), said)
        return out
