"""Step program: what the machine has. Python, torch and its CUDA, the packages the GPU path imports
(with where they came from: the carried wheels, the image, the source link), nvcc and ninja, and the
GPU. Fails when CUDA is there but flashinfer or radixserve's engine does not import.

    python -m gpu_check.versions --result PATH
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import shutil
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

PACKAGES = (
    "torch", "transformers", "triton", "flashinfer", "tvm_ffi", "llguidance", "jsonschema", "numpy",
    "einops", "tabulate", "matplotlib", "pytest", "pytest_timeout", "radixserve",
)  # fmt: skip


def package(name: str) -> dict[str, Any]:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # missing, or broken for this CUDA / torch
        return {"import_error": repr(e)[:300]}
    with warnings.catch_warnings():  # some packages deprecate __version__; it still answers
        warnings.simplefilter("ignore")
        version = str(getattr(mod, "__version__", "?"))
    return {"version": version, "from": str(Path(mod.__file__ or "?").parent)}


def tool(argv: list[str]) -> str | None:
    """The last line of a tool's version output (nvcc's names its release there), or None."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return repr(e)
    return out.splitlines()[-1] if out else ""


def gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"cuda_available": False}
    props = torch.cuda.get_device_properties(0)
    return {
        "cuda_available": True,
        "name": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
        "torch_cuda": torch.version.cuda,
        "nvidia_smi": tool(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        ),
    }


def engine_imports() -> str | None:
    """Why ``from radixserve import Engine`` fails, or None."""
    try:
        from radixserve import Engine  # noqa: F401
    except Exception:
        return traceback.format_exc(limit=3)[-600:]
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args()
    facts: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "gpu": gpu(),
        "packages": {name: package(name) for name in PACKAGES},
        "nvcc": tool(["nvcc", "--version"]),
        "ninja": tool(["ninja", "--version"]),
        "engine_import_error": engine_imports(),
    }
    print(json.dumps(facts, indent=1), flush=True)
    args.result.write_text(json.dumps(facts))
    cuda = facts["gpu"]["cuda_available"]
    broken = facts["engine_import_error"] or (cuda and "import_error" in facts["packages"]["flashinfer"])
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
