"""The tree stays readable in small pieces: no Python file over 500 lines, no function over 80.

Generated code (the protobuf stubs) and the virtual environment are not ours to shape.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
SKIP = {".venv", "pb", "build", "__pycache__", ".git"}


def python_files() -> list[Path]:
    return [
        p
        for p in ROOT.rglob("*.py")
        if not SKIP.intersection(p.relative_to(ROOT).parts) and not p.parts[-2].endswith(".egg-info")
    ]


def test_the_walk_sees_the_tree():
    names = {p.relative_to(ROOT).as_posix() for p in python_files()}
    assert {"services/scheduler/worker.py", "operator/handlers.py", "tests/repo/test_code_shape.py"} <= names
    assert not any(n.startswith((".venv/", "services/common/pb/")) for n in names)


def test_no_file_over_500_lines():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in python_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"split these by what their parts do: {long}"


def test_no_function_over_80_lines():
    long = {}
    for p in python_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}"] = n
    assert not long, f"give these named steps: {long}"
