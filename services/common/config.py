"""Service configuration: command-line flags, each also settable by an environment variable.

Every option ``--foo-bar`` of a service can come from ``RADIXSERVE_FOO_BAR`` (what the pods'
manifests set); a flag on the command line wins over the environment. ``--help`` lists the
variable beside each flag. ``--model demo`` means the generated demo model (built on first use).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

ENV_PREFIX = "RADIXSERVE_"


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` with defaults taken from the environment where a variable is set."""
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        var = env_name(action.dest)
        action.help = f"{action.help or ''} [env {var}]".strip()
        if var not in os.environ:
            continue
        raw = os.environ[var]
        if isinstance(action, argparse._StoreTrueAction):
            action.default = raw.strip().lower() in ("1", "true", "yes", "on")
        elif action.nargs in ("+", "*"):
            action.default = [action.type(x) if action.type else x for x in raw.split()]  # type: ignore[operator]
        else:
            action.default = action.type(raw) if action.type else raw  # type: ignore[operator]
        action.required = False
    return parser.parse_args(argv)


def demo_model_dir() -> Path:
    root = os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "radixserve"
    )
    return Path(root) / "demo-model"


def resolve_model(spec: str) -> Path:
    """A model folder, or "demo": the generated demo model, written on first use."""
    if spec != "demo":
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {spec}: no config.json there (a Hugging Face model folder is needed)")
        return path
    path = demo_model_dir()
    if not (path / "config.json").is_file():
        from radixserve.common.demo_model import make_demo_model

        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        make_demo_model(tmp, arch="llama", size="tiny")
        try:
            os.replace(tmp, path)  # atomic: concurrent first uses never see half a folder
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return path


def add_model_flag(parser: argparse.ArgumentParser, served_name: bool = False) -> None:
    parser.add_argument("--model", required=True, help='HF model folder, or "demo" (generated on first use)')
    if served_name:
        parser.add_argument(
            "--served-model-name",
            help="the name clients use (default: the folder's name; demo: radixserve-demo)",
        )


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return str(args.served_model_name)
    return "radixserve-demo" if args.model == "demo" else Path(args.model).resolve().name
