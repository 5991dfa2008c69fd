"""The vocabulary of fields.py's table: a field's policy, a row, and how a body is checked against
rows (a field's values found by path, a value compared with the neutral ones as JSON compares them)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel

CHAT, COMPLETIONS, RESPONSES = "chat", "completions", "responses"
BOTH = (CHAT, COMPLETIONS)


class Policy(Enum):
    IMPLEMENTED = "implemented"
    IGNORED = "accepted, ignored"
    NEUTRAL_ONLY = "only at a neutral value"


IMPLEMENTED, IGNORED, NEUTRAL_ONLY = Policy.IMPLEMENTED, Policy.IGNORED, Policy.NEUTRAL_ONLY


@dataclass(frozen=True, slots=True)
class FieldRule:
    path: str
    endpoints: tuple[str, ...]
    origin: str  # whose documents define it: OpenAI, vLLM, SGLang
    policy: Policy
    does: str  # what radixserve does with it (the docs table's text)
    neutral: tuple[object, ...] = ()  # NEUTRAL_ONLY: values that pass besides null (unset)
    same_as: str | None = None  # NEUTRAL_ONLY: passes when equal to this top-level field
    whole: bool = False  # covers every field below it


def row(
    path: str,
    endpoints: tuple[str, ...] | str,
    origin: str,
    policy: Policy,
    does: str,
    neutral: tuple[object, ...] = (),
    same_as: str | None = None,
    whole: bool = False,
) -> FieldRule:
    eps = (endpoints,) if isinstance(endpoints, str) else endpoints
    return FieldRule(path, eps, origin, policy, does, neutral, same_as, whole)


def refused_by(body: BaseModel, rows: Iterable[FieldRule]) -> tuple[str, str] | None:
    """The first field of ``body`` set to a value ``rows`` do not serve: (where, message)."""
    for rule in rows:
        if rule.policy is not NEUTRAL_ONLY:
            continue
        allowed = rule.neutral
        if rule.same_as is not None:
            allowed = (*allowed, getattr(body, rule.same_as))
        for where, value in values_at(body, rule.path):
            if not any(_same(value, ok) for ok in allowed):
                return where, f"{where}={_short(value)} is not supported by this server ({rule.does})"
    return None


def values_at(obj: object, path: str) -> Iterator[tuple[str, object]]:
    """The set (not null) values at ``path`` in ``obj``, with their concrete place (``messages.2.name``)."""
    yield from _walk(obj, path.split("."), [])


def _walk(obj: object, parts: list[str], where: list[str]) -> Iterator[tuple[str, object]]:
    if not parts:
        if obj is not None:
            yield ".".join(where), obj
        return
    head, rest = parts[0], parts[1:]
    many = head.endswith("[]")
    name = head[:-2] if many else head
    value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    if value is None:
        return
    if not many:
        yield from _walk(value, rest, [*where, name])
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, rest, [*where, name, str(i)])


def _same(value: object, neutral: object) -> bool:
    """JSON equality: ``false`` is not ``0``, ``1`` is ``1.0``."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    return value == neutral


def _short(value: object) -> str:
    text = repr(value.model_dump() if isinstance(value, BaseModel) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def markdown(rows: Iterable[FieldRule]) -> str:
    """``rows`` as a Markdown table (docs/api.md shows the endpoints')."""
    lines = ["| field | from | policy | what radixserve does |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r.path}` | {r.origin} | {r.policy.value} | {r.does.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
