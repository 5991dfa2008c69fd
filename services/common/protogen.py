"""Generates the Python gRPC stubs of proto/radixserve/v1/*.proto into services/common/pb/.

Run at install time by setup.py, by hand with ``python -m radixserve.common.protogen`` after
editing the contract, and on import (``load``) when a source checkout's stubs are missing or older
than the .proto. The generated files are never edited and never committed.

This module imports nothing from radixserve: setup.py loads it by path before the package exists.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
PROTO_ROOT = _HERE.parents[1] / "proto"  # the repository's proto/ (absent in a built wheel)
OUT_DIR = _HERE / "pb"
PROTOS = ("radixserve/v1/radixserve.proto",)


def _stale() -> bool:
    sources = [PROTO_ROOT / p for p in PROTOS]
    if not all(s.is_file() for s in sources):
        return False  # an installed wheel: its stubs were generated at build time
    outputs = [OUT_DIR / (Path(p).stem + suffix) for p in PROTOS for suffix in ("_pb2.py", "_pb2_grpc.py")]
    if not all(o.is_file() for o in outputs):
        return True
    return max(s.stat().st_mtime for s in sources) > min(o.stat().st_mtime for o in outputs)


def generate() -> list[Path]:
    """Write the stubs (and .pyi type stubs); returns the files written."""
    import tempfile

    from grpc_tools import protoc  # build-time dependency (grpcio-tools)

    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_ROOT / p) for p in PROTOS],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        OUT_DIR.mkdir(exist_ok=True)
        written = []
        for src in sorted(Path(tmp).rglob("*.py*")):
            text = src.read_text()
            # protoc names the import after the proto package (radixserve.v1); the stubs live here.
            text = re.sub(
                r"^from radixserve\.v1 import", "from radixserve.common.pb import", text, flags=re.M
            )
            dst = OUT_DIR / src.name
            dst.write_text(text)
            written.append(dst)
        init = OUT_DIR / "__init__.py"
        init.write_text('"""Generated gRPC stubs (radixserve.common.protogen); do not edit."""\n')
        written.append(init)
    return written


def ensure() -> None:
    """Generate the stubs if a source checkout's are missing or older than the contract."""
    if _stale():
        generate()


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
