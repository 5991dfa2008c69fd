"""The one config loader: typed config dataclasses -> command-line flags and environment variables.

A config field declared with ``setting(default, help)`` becomes the flag ``--foo-bar`` (field
``foo_bar``), also settable as ``RADIXSERVE_FOO_BAR`` (what the pods' manifests set); a flag on the
command line wins over the environment. ``--help`` lists the variable beside each flag. The
services' configs live in ``service_config.py``. ``--model demo`` means the generated demo model
(built on first use).

Bad input is one line naming it, before a service starts anything: a number outside its setting's
``Bounds`` is refused as the flag (or variable) is parsed, two settings in conflict by the config
class's ``check`` (``load``), a model folder that cannot be one by ``model_problem``; the services'
``__main__`` and ``radixserve serve`` (which checks every service's command line before starting
any) share all of it through ``load_service`` / ``service_parser``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn, TypedDict, TypeVar

from radixserve.common.weight_manifest import MANIFEST

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "RADIXSERVE_"
CACHE_DIR_ENV = ENV_PREFIX + "CACHE_DIR"  # where the demo model is written (not a flag)

T = TypeVar("T")
C = TypeVar("C", bound="DataclassInstance")


class ConfigError(ValueError):
    """A setting that cannot work (out of its range, in conflict with another, a port in use); the
    message is the one line a failed start prints, and names the flag."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line ends in one line (``PROG: error: MESSAGE``) and status 2,
    without the usage block: the cause is the line a user or a pod's log shows."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class RaisingParser(OneLineParser):
    """Raises ConfigError instead of exiting: for checking a service's command line in another
    process (``radixserve serve`` checks its services' before it starts any)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The values a numeric setting admits: ``low`` (excluded when ``low_open``) to ``high``. NaN
    and infinities are never admitted: no setting means anything by them."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def admits(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return above and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is None:
            return "a finite number" if self.high is None else f"at most {high}"
        if self.high is None:
            return f"above {low}" if self.low_open else f"at least {low}"
        return f"in ({low}, {high}]" if self.low_open else f"{low} to {high}"


def _number(x: float | None) -> str:
    """``x`` as a user wrote it: 65535, not 65535.0."""
    return str(int(x)) if isinstance(x, int) or (x is not None and x.is_integer()) else f"{x}"


class _Meta(TypedDict):
    """What ``setting`` keeps in a field's metadata."""

    help: str
    choices: Sequence[str] | None
    required: bool
    negation: tuple[str, str] | None
    bounds: Bounds | None


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
    bounds: Bounds | None = None,
) -> T:
    """A config field that is also a flag. ``negation``: (flag, help) of a second flag that sets
    a ``bool | None`` field to False (``--enable-overlap`` for ``disable_overlap``). ``bounds``: the
    values a number admits; the flag (and its environment variable) refuses others by name."""
    meta: _Meta = {
        "help": help,
        "choices": choices,
        "required": required,
        "negation": negation,
        "bounds": bounds,
    }
    return dataclasses.field(default=default, metadata=meta)


_KIND = {int: "an integer", float: "a number"}


def number_type(base: type[int] | type[float], bounds: Bounds | None) -> Callable[[str], object]:
    """An argparse ``type`` for a number within ``bounds``: a value outside them is the flag's
    error (one line naming the range), not a failure later in the service."""

    limits = bounds or Bounds()  # at least finite

    def parse(raw: str) -> object:
        try:
            value = base(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_KIND[base]}, got {raw!r}") from None
        if not limits.admits(value):
            raise argparse.ArgumentTypeError(f"must be {limits} (got {raw})")
        return value

    return parse


def flag_type(cls: type[DataclassInstance], name: str) -> Callable[[str], object]:
    """The argparse ``type`` of ``cls``'s numeric setting ``name``, its bounds included: for a
    command line that takes the same value under a flag of its own (``radixserve serve --port``)."""
    f, hint = _setting(cls, name)
    base, meta = _base(hint), _meta(f)
    if (base is not int and base is not float) or meta is None:
        raise TypeError(f"{cls.__name__}.{name} is not a numeric setting")
    return number_type(int if base is int else float, meta["bounds"])


def _fields(cls: type[DataclassInstance]) -> list[tuple[dataclasses.Field[object], object]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _config_class(hint: object) -> type[DataclassInstance] | None:
    """``hint`` if it is a nested config (a dataclass), else None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _setting(cls: type[DataclassInstance], name: str) -> tuple[dataclasses.Field[object], object]:
    """The field of setting ``name`` and its type hint, found in ``cls`` or a config nested in it."""
    for f, hint in _fields(cls):
        nested = _config_class(hint)
        if nested is not None and name in flag_fields(nested):
            return _setting(nested, name)
        if nested is None and f.name == name and _meta(f) is not None:
            return f, hint
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


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
            elif base is int or base is float:  # parsed and held to its bounds at the flag
                kw["type"] = number_type(int if base is int else float, meta["bounds"])
            elif callable(base):  # str: the field's type parses the flag's value
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
    """Parse ``argv`` with defaults taken from the environment where a variable is set. A flag on
    the command line wins: its variable is not read at all (a stale bad value there is no error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        var = env_name(action.dest)
        action.help = f"{action.help or ''} [env {var}]".strip()
        if var not in os.environ or _given(action, args):
            continue
        raw = os.environ[var]
        if isinstance(action, argparse._StoreFalseAction):  # the negation of a flag set above
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            action.default = env_flag(raw)
        elif action.nargs in ("+", "*"):
            action.default = [_convert(parser, action, var, x) for x in raw.split()]
        else:
            action.default = _convert(parser, action, var, raw)
        action.required = False
    return parser.parse_args(args)


def _given(action: argparse.Action, argv: Sequence[str]) -> bool:
    """Whether ``argv`` sets ``action``'s flag itself (``--flag V`` or ``--flag=V``)."""
    return any(a.split("=", 1)[0] in action.option_strings for a in argv)


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, var: str, raw: str) -> object:
    """``raw`` parsed by the flag's type (add_flags gives every valued flag a callable one); a value
    it refuses is the parser's error naming the variable, as a flag's would name the flag."""
    if not callable(action.type):
        return raw
    try:
        value = action.type(raw)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        parser.error(f"environment {var}: {e}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"environment {var}: {raw!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def check(cfg: DataclassInstance) -> None:
    """Raises ConfigError for the first rule ``cfg`` breaks that no single flag's range can say
    (two settings in conflict): each config class states its own in a ``check`` method, nested
    configs included. A setting's own range is checked when it is parsed (``Bounds``)."""
    for f, hint in _fields(type(cfg)):
        if _config_class(hint) is not None:
            check(getattr(cfg, f.name))
    own = getattr(cfg, "check", None)
    if callable(own):
        own()


def load(cls: type[C], args: argparse.Namespace) -> C:
    """``cls`` from parsed flags, checked (``check``): ConfigError names what cannot work."""
    cfg = from_args(cls, args)
    check(cfg)
    return cfg


def load_service(
    parser: argparse.ArgumentParser, cls: type[C], argv: Sequence[str] | None, weights: bool = False
) -> tuple[argparse.Namespace, C]:
    """A service module's flags and environment as its checked config (``load``) and the parsed
    arguments (``--model`` among them, looked at too): what its start needs, or ConfigError naming
    the first thing that cannot work, before the service imports or starts anything. ``parser``
    should be a ``RaisingParser``, so a bad flag is a ConfigError too; ``weights``: the model's
    folder must hold them (``model_problem``)."""
    args = parse_args(parser, argv)
    cfg = load(cls, args)
    problem = model_problem(args.model, weights)
    if problem is not None:
        raise ConfigError(problem)
    return args, cfg


def service_parser(
    cls: type[DataclassInstance],
    prog: str,
    description: str | None = None,
    served_name: bool = False,
    parser_class: type[argparse.ArgumentParser] = OneLineParser,
) -> argparse.ArgumentParser:
    """A service module's parser: ``--model`` (and ``--served-model-name``) plus ``cls``'s settings.
    ``radixserve serve`` builds the same one (``RaisingParser``) to check a service's command line."""
    p = parser_class(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flag(p, served_name=served_name)
    add_flags(p, cls)
    return p


def demo_model_dir() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "radixserve"
    )
    return Path(root) / "demo-model"


# A tokenizer transformers' AutoTokenizer can load is one of these files in the model's folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_problem(spec: str, weights: bool = False) -> str | None:
    """Why ``--model spec`` cannot be served, from its folder's file names and config.json alone (no
    library loads anything); None if it may be. ``weights``: it must hold *.safetensors too (the
    scheduler's; the gateway and the detokenizer need only the tokenizer)."""
    if spec == "demo":
        return None
    path = Path(spec)
    if not path.exists():
        if spec.count("/") == 1 and not spec.startswith((".", "/")):  # a Hugging Face id, as vLLM takes
            return (
                f"--model {spec}: no such folder (a Hugging Face id? radixserve fetch-model hf://{spec}"
                " --cache DIR downloads it and prints its folder)"
            )
        return f"--model {spec}: no such folder"
    if not (path / "config.json").is_file():
        return f"--model {spec}: no config.json there (a Hugging Face model folder is needed)"
    try:
        if not isinstance(json.loads((path / "config.json").read_text()), dict):
            return f"--model {spec}: config.json is not a JSON object"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"--model {spec}: config.json cannot be read ({' '.join(str(e).split())})"
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"--model {spec}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})"
    if weights and not any(path.glob("*.safetensors")) and not (path / MANIFEST).is_file():
        return f"--model {spec}: no weights there (*.safetensors, or {MANIFEST} naming them in a store)"
    return None


def load_format_problem(folder: Path, load_format: str) -> str | None:
    """Why ``--load-format`` cannot load the model in ``folder``; None if it can. ``auto`` reads the
    folder's weights, or streams them where the folder was fetched without them; ``stream`` insists:
    the weights must be in an s3:// or gs:// store (fetch-model --skip-weights wrote the manifest)."""
    if load_format != "stream" or (folder / MANIFEST).is_file():
        return None
    from radixserve.common.model_cache import MARKER, EntryRecord  # (at need: services start light)

    try:  # a cache entry's record: the URI fetched
        origin = EntryRecord.from_json((folder.parent / MARKER).read_text()).uri
    except (OSError, ValueError, TypeError, AttributeError):
        origin = f"the local folder {folder}"
    return (
        f"--load-format stream: the model is {origin}, whose weights are files here; only s3:// and gs://"
        " models fetched with fetch-model --skip-weights stream (--load-format auto loads this one)"
    )


def model_path(spec: str) -> Path:
    """Where ``--model spec`` is (the demo model's folder, written or not): no file is written."""
    return demo_model_dir() if spec == "demo" else Path(spec)


def resolve_model(spec: str) -> Path:
    """A model folder, or "demo": the generated demo model, written on first use. SystemExit with
    one line when the folder is not a model's."""
    problem = model_problem(spec)
    if problem is not None:
        raise SystemExit(problem)
    path = model_path(spec)
    if spec != "demo":
        return path
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
