#!/usr/bin/env python3
"""Print the pip requirements a container image installs, one per line, read from pyproject.toml.

    python3 scripts/image_requirements.py service --extra gpu   the package's dependencies, the extras
                                                                (--extra gpu,s3 for several) and the
                                                                build backend (Dockerfile)
    python3 scripts/image_requirements.py operator              the operator's share: no torch, no
                                                                transformers (Dockerfile.operator)
    python3 scripts/image_requirements.py build                 the build backend only (to build the wheel)

The Dockerfiles run it with nothing but pyproject.toml copied in, so their dependency layers are
rebuilt when pyproject.toml changes and not when the code does; the versions stay written once, in
pyproject.toml. Needs Python 3.11+ (tomllib), which both images' bases have. Standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

# What `python -m radixserve.operator` imports (tests/repo/test_images.py imports every operator module in
# a venv holding only these): kopf and the Kubernetes client; redis (the Redis ACL users, the scheduler load
# that autoscaling reads); numpy and xxhash, because radixserve.common.service_config, which the
# manifest builders read their defaults from, imports radixserve.common.block_hash.
OPERATOR_PACKAGES = ("kopf", "kubernetes", "redis", "numpy", "xxhash")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def canonical(name: str) -> str:
    """The PEP 503 form of a distribution name: ``Foo_Bar.baz`` and ``foo-bar-baz`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement.strip())
    if match is None:
        raise ValueError(f"pyproject.toml: cannot read a package name in the requirement {requirement!r}")
    return canonical(match.group())


def build_requirements(project: dict[str, Any]) -> list[str]:
    return list(project.get("build-system", {}).get("requires", []))


def service_requirements(project: dict[str, Any], extras: list[str]) -> list[str]:
    """Every dependency, the named extras' and the build backend's (the source is then installed with
    --no-deps --no-build-isolation, so all of it must be here)."""
    optional = project["project"].get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ValueError(f"--extra: no such extra in pyproject.toml: {unknown} (known: {sorted(optional)})")
    requirements = list(project["project"]["dependencies"])
    for extra in extras:
        requirements += optional[extra]
    return _unique(requirements + build_requirements(project))


def operator_requirements(project: dict[str, Any]) -> list[str]:
    """pyproject's own lines for OPERATOR_PACKAGES, so the operator image gets the same version floors."""
    by_name = {requirement_name(r): r for r in project["project"]["dependencies"]}
    missing = [name for name in OPERATOR_PACKAGES if name not in by_name]
    if missing:
        raise ValueError(f"pyproject.toml [project] dependencies lack the operator's packages {missing}")
    return [by_name[name] for name in OPERATOR_PACKAGES]


def _unique(requirements: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for requirement in requirements:
        if requirement not in seen:
            seen.add(requirement)
            out.append(requirement)
    return out


def requirements(image: str, extras: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())
    if image == "service":
        return service_requirements(project, extras)
    if extras:
        raise ValueError(f"--extra applies to the service image only, not {image!r}")
    if image == "operator":
        return operator_requirements(project)
    return build_requirements(project)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("image", choices=["service", "operator", "build"])
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        help="optional-dependencies groups (repeat, or comma-separated)",
    )
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    args = parser.parse_args(argv)
    try:
        extras = [e for value in args.extra for e in re.split(r"[,\s]+", value) if e]
        lines = requirements(args.image, extras, args.pyproject)
    except (ValueError, KeyError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"image_requirements: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
