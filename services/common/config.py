"""The one config loader: typed config dataclasses -> command-line flags and environment variables.

A config field declared with ``setting(default, help)`` becomes the flag ``--foo-bar`` (field
``foo_bar``), also settable as ``RADIXSERVE_FOO_BAR`` (what the pods' manifests set); a flag on the
command line wins over the environment. ``--help`` lists the variable beside each flag. The
services' configs live in ``service_config.py``. ``--model demo`` means the generated demo model
(built on first use).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "RADIXSERVE_"

C = TypeVar("C")


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    required: bool = False,
    negation: tuple[str, str] | None = None,
) -> Any:
    """A config field that is also a flag. ``negation``: (flag, help) of a second flag that sets
    a ``bool | None`` field to False (``--enable-overlap`` for ``disable_overlap``)."""
    meta = {"help": help, "choices": choices, "required": required, "negation": negation}
    return dataclasses.field(default=default, metadata=meta)


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _base(hint: Any) -> Any:
    """``int | None`` -> int; ``tuple[str, ...]`` -> tuple; others as they are."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return _base(args[0])
    return typing.get_origin(hint) or hint


def flag_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """Every field of ``cls`` (and of the configs nested in it) that is a flag, by name."""
    out: dict[str, dataclasses.Field[Any]] = {}
    for f, hint in _fields(cls):
        if dataclasses.is_dataclass(hint):
            out.update(flag_fields(hint))
        elif "help" in f.metadata:
            out[f.name] = f
    return out


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per ``setting`` field of ``cls``, nested configs included, defaults from the class."""
    for f, hint in _fields(cls):
        if dataclasses.is_dataclass(hint):
            add_flags(parser, hint)
            continue
        if "help" not in f.metadata:
            continue
        meta, base = f.metadata, _base(hint)
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if meta["required"]:
            kw["required"] = True
        else:
            kw["default"] = f.default
        if base is bool and meta["negation"] is not None:  # bool | None: two flags, None when neither
            parser.add_argument(flag, action="store_true", **kw)
            neg, neg_help = meta["negation"]
            parser.add_argument(neg, dest=f.name, action="store_false", default=None, help=neg_help)
        elif base is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            parser.add_argument(flag, **kw)
        else:
            if base is tuple:
                kw.update(nargs="+", type=str)
            else:
                kw["type"] = base
            if meta["choices"]:
                kw["choices"] = meta["choices"]
            if not meta["required"] and f.default is not None and "(default" not in meta["help"]:
                kw["help"] += f" (default {f.default})"
            parser.add_argument(flag, **kw)


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    """``cls`` from parsed flags (nested configs too); fields that are not flags keep their default."""
    values: dict[str, Any] = {}
    for f, hint in _fields(cls):
        if dataclasses.is_dataclass(hint):
            values[f.name] = from_args(hint, args)
        elif "help" in f.metadata and hasattr(args, f.name):
            v = getattr(args, f.name)
            values[f.name] = tuple(v) if _base(hint) is tuple and v is not None else v
    return cls(**values)


def env_var(cls: type, name: str) -> str:
    """The environment variable of ``cls``'s setting ``name`` (KeyError if it has none)."""
    if name not in flag_fields(cls):
        raise KeyError(f"{cls.__name__} has no setting {name!r}")
    return env_name(name)


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
        if isinstance(action, argparse._StoreFalseAction):  # the negation of a flag set above
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
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
