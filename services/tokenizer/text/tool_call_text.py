"""Reading a tool call's JSON text as the model writes it: the pieces tool_calls.py's parsers share.

A call body is ``{"name": "N", "<arguments key>": {...}}``. ``CallHead.read`` tells how far its head
has come (the name, then the key of the arguments); ``object_end`` matches the braces of an object
as it grows (resumable, so a long one is walked once); ``whole_call`` judges a body that cannot be
streamed once it is complete. The parsers turn text into ``Event`` s: content, a call's start
(``CallOpen``), a piece of its arguments (``CallArgs``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

WS = " \t\r\n"


# Scanner events: content text, a call's start (its name), a piece of its arguments.
@dataclass(frozen=True, slots=True)
class CallOpen:
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    text: str


Event = str | CallOpen | CallArgs


def json_object(text: str) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object, or None (not JSON, or JSON of another type)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def whole_call(body: str, args_keys: tuple[str, ...], args_required: bool) -> list[Event] | None:
    """A complete call object that did not stream (name not first): its events, or None when it is
    not a call (bad JSON, no name, arguments that are not an object)."""
    obj = json_object(body)
    if obj is None:
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in args_keys if k in obj), None)
    if key is None and args_required:
        return None
    args: object = {} if key is None else obj[key]
    if isinstance(args, str):  # some models double-encode the arguments
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return [CallOpen(name), CallArgs(json.dumps(args, ensure_ascii=False))]


def held_len(seg: str, marker: str) -> int:
    """How much of ``seg`` (content at the end of the text so far) may not go out yet: a partial
    ``marker`` at its end and the whitespace before it (markup if a call follows)."""
    end = len(seg)
    for k in range(min(len(marker) - 1, len(seg)), 0, -1):
        if seg.endswith(marker[:k]):
            end -= k
            break
    return len(seg) - len(seg[:end].rstrip(WS))


_STRUCT_RE = re.compile(r'["{}]')
STRING_BODY_RE = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # up to the closing quote


def object_end(
    s: str, start: int, resume: tuple[int, int, bool] | None = None
) -> tuple[int | None, tuple[int, int, bool]]:
    """Index just past the ``}`` that closes the ``{`` at ``s[start]`` (strings and escapes
    respected), or None when ``s`` ends first; with where to resume once ``s`` has grown (offset
    from ``start``, depth, inside a string). Only braces are matched: whether the text is valid JSON
    is ``json.loads``'s call. Depends only on ``s[start:end]``, so a prefix never disagrees."""
    offset, depth, in_string = resume if resume is not None else (0, 0, False)
    i = start + offset
    while True:
        if in_string:
            m = STRING_BODY_RE.match(s, i)
            assert m is not None  # it matches the empty string
            i = m.end()
            if i == len(s) or s[i] != '"':  # the text ends in the string (maybe on a lone backslash)
                return None, (i - start, depth, True)
            i += 1
            in_string = False
            continue
        m = _STRUCT_RE.search(s, i)
        if m is None:
            return None, (len(s) - start, depth, False)
        i = m.end()
        c = m.group()
        if c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return i, (i - start, 0, False)


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


class CallHead:
    """Reading ``{"name": "N", "<args key>": `` at the start of a call body, as far as it has come."""

    MORE, NO = "more", "no"  # the text ends before it can tell; it is not this form
    NAME_MORE, NAME_ONLY, ARGS = "name_more", "name_only", "args"

    @classmethod
    def read(cls, s: str, i: int, keys: tuple[str, ...]) -> tuple[str, str | None, int]:
        """(status, the name once read, an index): MORE or NO before the name is read; then
        NAME_MORE (the text ends before the arguments key is told), NAME_ONLY (no arguments key
        follows the name: ``}`` or another key) or ARGS (the arguments value starts at the index)."""
        i = skip_ws(s, i)
        for lit in ("{", '"name"', ":"):
            i, got = cls._literal(s, skip_ws(s, i), lit)
            if got != "yes":
                return got, None, i
        i = skip_ws(s, i)
        if i == len(s):
            return cls.MORE, None, i
        if s[i] != '"':
            return cls.NO, None, i
        m = STRING_BODY_RE.match(s, i + 1)
        assert m is not None
        if m.end() == len(s) or s[m.end()] != '"':
            return cls.MORE, None, i
        try:
            name = json.loads(s[i : m.end() + 1])
        except ValueError:
            return cls.NO, None, i
        if not isinstance(name, str) or not name:
            return cls.NO, None, i
        after = m.end() + 1
        j, got = cls._literal(s, skip_ws(s, after), ",")
        if got != "yes":
            return (cls.NAME_MORE if got == cls.MORE else cls.NAME_ONLY), name, after
        j = skip_ws(s, j)
        for key in keys:
            k, got = cls._literal(s, j, f'"{key}"')
            if got == "yes":
                k, got = cls._literal(s, skip_ws(s, k), ":")
            if got == "yes":
                return cls.ARGS, name, skip_ws(s, k)
            if got == cls.MORE:
                return cls.NAME_MORE, name, after
        return cls.NAME_ONLY, name, after

    @classmethod
    def _literal(cls, s: str, i: int, lit: str) -> tuple[int, str]:
        """(index past ``lit``, "yes") when ``s[i:]`` starts with it; MORE when ``s`` ends inside it."""
        rest = s[i : i + len(lit)]
        if rest == lit:
            return i + len(lit), "yes"
        return i, cls.MORE if lit.startswith(rest) else cls.NO


@dataclass(slots=True)
class CallBody:
    """One call body being read: its head, then its arguments as they come, then its end."""

    start: int  # where the body (its '{', after any whitespace) starts in the text
    phase: str = "head"  # head | args | tail | whole
    name: str | None = None  # known from the head on
    opened: bool = False  # its CallOpen went out
    args_start: int = 0
    sent: int = 0  # arguments emitted up to here
    resume: tuple[int, int, bool] | None = None  # object_end's, for the object being matched
    args_end: int = 0  # just past the arguments (phase tail)


@dataclass(slots=True)
class ScanState:
    """Where the scan stands: text up to ``pos`` is decided."""

    pos: int = 0
    after_call: bool = False  # markup whitespace (and ';') may follow
    at_start: bool = True  # llama3_json: a bare '{' here may open a call
    body: CallBody | None = None
    marker_at: int = -1  # where the marker that opened ``body`` starts (its text, if not a call)
    tagged: bool = False  # llama3_json: the body follows <|python_tag|>
    events: list[Event] = field(default_factory=list)


def merged(events: list[Event]) -> list[Event]:
    """Adjacent content pieces as one, empty ones left out."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, str):
            if not e:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += e
                continue
        out.append(e)
    return out
