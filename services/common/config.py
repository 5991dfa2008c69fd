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
import functools
import os
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "RADIXSERVE_"
CACHE_DIR_ENV = ENV_PREFIX + "CACHE_DIR"  # where the demo model is written (not a flag)

T = TypeVar("T")
C = TypeVar("C", bound="DataclassInstance")


class _Meta(TypedDict):
    """What ``setting`` keeps in a field's metadata."""

    help: str
    choices: Sequence[str] | None
    required: bool
    negation: tuple[str, str] | None


class _FlagArgs(TypedDict, total=False):
    """The keyword arguments ``add_flags`` hands ``add_argument``."""

    dest: str
    help: str
    required: bool
    default: object
    action: Literal["store_true"] | type[argparse.Action]
    nargs: Literal["+"]
    type: Callable[[str], object]
    choices: Sequence[str]


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def setting(
    default: T,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    required: bool = False,
    negation: tuple[str, str] | None = None,
) -> T:
    """A config field that is also a flag. ``negation``: (flag, help) of a second flag that sets
    a ``bool | None`` field to False (``--enable-overlap`` for ``disable_overlap``)."""
    meta: _Meta = {"help": help, "choices": choices, "required": required, "negation": negation}
    return dataclasses.field(default=default, metadata=meta)


def _fields(cls: type[DataclassInstance]) -> list[tuple[dataclasses.Field[object], object]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _config_class(hint: object) -> type[DataclassInstance] | None:
    """``hint`` if it is a nested config (a dataclass), else None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _meta(f: dataclasses.Field[object]) -> _Meta | None:
    """The ``setting`` metadata of ``f``; None if it is not a flag."""
    return typing.cast(_Meta, f.metadata) if "help" in f.metadata else None


def _base(hint: object) -> object:
    """``int | None`` -> int; ``tuple[str, ...]`` -> tuple; others as they are."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return _base(args[0])
    return typing.get_origin(hint) or hint


@functools.cache  # the operator names variables through it on every build
def flag_fields(cls: type[DataclassInstance]) -> dict[str, dataclasses.Field[object]]:
    """Every field of ``cls`` (and of the configs nested in it) that is a flag, by name."""
    out: dict[str, dataclasses.Field[object]] = {}
    for f, hint in _fields(cls):
        if (nested := _config_class(hint)) is not None:
            out.update(flag_fields(nested))
        elif _meta(f) is not None:
            out[f.name] = f
    return out


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type[DataclassInstance]
) -> None:
    """One flag per ``setting`` field of ``cls``, nested configs included, defaults from the class."""
    for f, hint in _fields(cls):
        if (nested := _config_class(hint)) is not None:
            add_flags(parser, nested)
            continue
        meta = _meta(f)
        if meta is None:
            continue
        base = _base(hint)
        flag = "--" + f.name.replace("_", "-")
        kw: _FlagArgs = {"dest": f.name, "help": meta["help"]}
        if meta["required"]:
            kw["required"] = True
        else:
            kw["default"] = f.default
        if base is bool and meta["negation"] is not None:  # bool | None: two flags, None when neither
            kw["action"] = "store_true"
            parser.add_argument(flag, **kw)
            neg, neg_help = meta["negation"]
            parser.add_argument(neg, dest=f.name, action="store_false", default=None, help=neg_help)
        elif base is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            parser.add_argument(flag, **kw)
        else:
            if base is tuple:
                kw["nargs"], kw["type"] = "+", str
            elif callable(base):  # int, float, str: the field's type parses the flag's value
                kw["type"] = base
            else:
                raise ValueError(f"{cls.__name__}.{f.name}: no flag for a field of type {hint!r}")
            if meta["choices"]:
                kw["choices"] = meta["choices"]
            if not meta["required"] and f.default is not None and "(default" not in meta["help"]:
                kw["help"] += f" (default {f.default})"
            parser.add_argument(flag, **kw)


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    """``cls`` from parsed flags (nested configs too); fields that are not flags keep their default."""
    values: dict[str, object] = {}
    for f, hint in _fields(cls):
        if (nested := _config_class(hint)) is not None:
            values[f.name] = from_args(nested, args)
        elif _meta(f) is not None and hasattr(args, f.name):
            v = getattr(args, f.name)
            values[f.name] = tuple(v) if _base(hint) is tuple and v is not None else v
    return cls(**values)


def env_var(cls: type[DataclassInstance], name: str) -> str:
    """The environment variable of ``cls``'s setting ``name`` (KeyError if it has none)."""
    if name not in flag_fields(cls):
        raise KeyError(f"{cls.__name__} has no setting {name!r}")
    return env_name(name)


def env_flag(raw: str) -> bool:
    """A boolean setting's environment value: 1 / true / yes / on (any case) is true."""
    return raw.strip().lower() in ("1", "true", "yes", "on")


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
            action.default = env_flag(raw)
        elif action.nargs in ("+", "*"):
            action.default = [_convert(action, x) for x in raw.split()]
        else:
            action.default = _convert(action, raw)
        action.required = False
    return parser.parse_args(argv)


def _convert(action: argparse.Action, raw: str) -> object:
    """``raw`` parsed by the flag's type (add_flags gives every valued flag a callable one)."""
    return action.type(raw) if callable(action.type) else raw


def demo_model_dir() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
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
