"""``prepare``, run here (with network): the wheels the GPU machine lacks, downloaded for its Python
into the ignored folder that the device tool carries, the size of what a device call sends checked,
and the exact call for each phase printed.

What the machine lacks (/work/shared/TOOLCHAIN.md, the device tool's package list): flashinfer at
the Dockerfile's version and the tvm-ffi it needs; llguidance (imported by ``from radixserve import
Engine``); jsonschema and its own dependencies (tests/gpu). einops and tabulate are on its image but
carried too (a few kB; flashinfer does not import without them), and typing-extensions because
tvm-ffi asks for a newer one than some images hold. Versions are pinned: those this checkout's
tests run with. Everything else the GPU steps import (torch, transformers, numpy, matplotlib,
pytest, pytest-timeout, xxhash, ...) is on the image; the requirements the carried wheels name that
are not carried are printed, to be read against it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from .env import WHEEL_DIR

TREE_LIMIT = 64 << 20  # what one device call may send: tracked and untracked-unignored files + carried
PYTHON = "3.12"  # the GPU machine's
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
PINNED = (
    "apache-tvm-ffi>=0.1.6,<0.2",  # flashinfer 0.6's own requirement (checked after the download)
    "einops==0.8.2",
    "tabulate==0.10.0",
    "typing-extensions==4.16.0",
    "llguidance==1.9.1",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
)
# Named by flashinfer-python's metadata, absent from the image, and not imported by the kernels the
# engine uses (tests/gpu passed without them on an H100, TOOLCHAIN.md): not carried.
NOT_NEEDED = ("nvidia-cudnn-frontend", "nvidia-cutlass-dsl")


def flashinfer_version(repo: Path) -> str:
    """The Dockerfile's ``ARG FLASHINFER_VERSION``: the image and the GPU checks use one release."""
    m = re.search(r"^ARG FLASHINFER_VERSION=(\S+)$", (repo / "Dockerfile").read_text(), re.M)
    if m is None:
        raise SystemExit("Dockerfile: no ARG FLASHINFER_VERSION")
    return m.group(1)


def wanted(repo: Path) -> list[str]:
    return [f"flashinfer-python=={flashinfer_version(repo)}", *PINNED]


def download(specs: list[str], dest: Path) -> None:
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    argv += ["--python-version", PYTHON, "--implementation", "cp", "-d", str(dest)]
    argv += [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    subprocess.run(argv + specs, check=True)


def metadata_requires(wheel: Path) -> list[Requirement]:
    """A wheel's Requires-Dist lines, extras' left out."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(name).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"python_version": PYTHON, "extra": ""})]


def check_consistent(wheels: list[Path]) -> list[str]:
    """One wheel per project, and every requirement between carried wheels met by the carried
    version; returns the requirements left to the machine's image."""
    versions: dict[str, Version] = {}
    for w in wheels:
        name, version, _, _ = parse_wheel_filename(w.name)
        if name in versions:
            raise SystemExit(f"two wheels of {name} in {WHEEL_DIR}/: pip would refuse both")
        versions[name] = version
    left = set()
    for w in wheels:
        for req in metadata_requires(w):
            have = versions.get(canonicalize_name(req.name))
            if have is None:
                left.add(str(req))
            elif not req.specifier.contains(have, prereleases=True):
                raise SystemExit(f"{w.name} needs {req}, carried {have}")
    return sorted(left)


def tree_bytes(repo: Path) -> int:
    """What the device tool sends besides the carried folder: tracked files and untracked ones git
    does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo, check=True, capture_output=True,
    ).stdout  # fmt: skip
    total = 0
    for name in out.decode().split("\0"):
        path = repo / name
        if name and (path.exists() or path.is_symlink()):
            total += path.lstat().st_size
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def phase_call(phase: str) -> str:
    """The device tool's ``run`` arguments for ``phase``, as JSON: the command runs in the repository
    root with $OUT set to its result folder, which the script writes to."""
    return json.dumps(
        {"command": f"python3 scripts/gpu-check {phase}", "carry": [WHEEL_DIR], "timeout_s": 600}
    )


def prepare(repo: Path) -> int:
    dest = repo / WHEEL_DIR
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        download(wanted(repo), Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        left = check_consistent(wheels)
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        for w in wheels:
            shutil.move(str(w), dest / w.name)
    wheels = sorted(dest.glob("*.whl"))
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    from_image = [r for r in left if not r.startswith(NOT_NEEDED)]
    print("needed from the GPU machine's image:", ", ".join(from_image))
    print("named but not needed (not carried):", ", ".join(r for r in left if r.startswith(NOT_NEEDED)))
    tree, carried = tree_bytes(repo), folder_bytes(dest)
    total = tree + carried
    print(
        f"sent per device call: tree {tree / 2**20:.1f} MiB + {WHEEL_DIR}/ {carried / 2**20:.1f} MiB"
        f" = {total / 2**20:.1f} MiB of {TREE_LIMIT >> 20} MiB"
    )
    if total >= TREE_LIMIT:
        print("too big for a device call", file=sys.stderr)
        return 1
    for phase in ("phase1", "phase2"):
        print(f"{phase}, the device tool's run with: {phase_call(phase)}")
    return 0
