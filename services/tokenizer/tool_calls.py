"""OpenAI tool calls for ``/v1/chat/completions``: validate ``tools``, shape messages for the chat
template, constrain decoding for ``tool_choice``, and parse the model's text back into ``tool_calls``.

The model never sees OpenAI's JSON: the model folder's chat template renders ``tools`` (and past calls
and tool results) in the model's own format, and the model answers in that format. Two formats are
understood, picked from the template text (``parser_for_template``):

* ``hermes`` (Qwen2.5, Hermes, the demo model's ChatML template): each call is a block
  ``<tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call>`` anywhere in the output;
* ``llama3_json`` (Llama 3.1/3.2 with JSON tool calling): the output *is* the call,
  ``{"name": "N", "parameters": {...}}`` (several may follow each other, ``;``-separated), optionally
  after a ``<|python_tag|>`` marker, which may also follow some prose.

Parsing never loses model output: text that looks like a call but is not one (bad JSON, no name)
stays content. Whitespace touching a recognised call is part of the format's markup (the newline
before ``<tool_call>``, the ``;`` between Llama calls) and is dropped; all other text is content
verbatim, so an output with no calls parses to itself.

Streaming and whole-output parsing share one scanner (``_scan``): the stream rescans only what it has
not yet decided, so any chunking of an output yields the same content and calls as ``parse``. A call
is emitted as one delta (id, name and the complete arguments) once its text is complete and has
parsed: emitting a name earlier could not be taken back if the call then turned out malformed.

``tool_choice`` is enforced by a grammar that only these formats' calls match (tool_grammar.py).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

_WS = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str  # "call_<24 hex>"
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed piece of a call: OpenAI's ``chat.completion.chunk`` ``delta.tool_calls[i]``."""

    index: int  # which call of this message (0, 1, ...)
    id: str | None  # with the first delta of a call only
    name: str | None  # with the first delta of a call only
    arguments: str  # a fragment of the arguments JSON


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class _Call:
    """A call found by the scanner, before it is given an id."""

    name: str
    arguments: str


_Event = str | _Call  # scanner output: content text, or a call


@dataclass(slots=True)
class _ScanState:
    """What the scanner must remember between two scans of a stream (at a decided position)."""

    after_call: bool = False  # the last thing scanned was a call: whitespace (and ';') here is markup
    at_start: bool = True  # llama3_json: a bare '{' here may open a call (start of output / after a call)
    # When the undecided text is an open call (no end marker / closing brace yet), the one character
    # that must arrive before rescanning can decide anything; None: rescan on every feed.
    wait: str | None = None
    # llama3_json: how far the open object's brace matching got (_object_end's resume point), so the
    # next scan resumes there instead of walking the whole object again.
    open_object: tuple[int, int, bool] | None = None


def _decode_call(body: str, args_keys: tuple[str, ...], args_required: bool) -> _Call | None:
    """A call from its JSON text, or None when it is not one (bad JSON, no name, arguments that are
    not an object). ``args_keys``: where the format keeps the arguments, preferred key first."""
    obj = _json_object(body)
    if obj is None:
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in args_keys if k in obj), None)
    if key is None:
        if args_required:
            return None
        args: object = {}
    else:
        args = obj[key]
    if isinstance(args, str):  # some models double-encode the arguments
        args = _json_object(args)
    if not isinstance(args, dict):
        return None
    return _Call(name, json.dumps(args, ensure_ascii=False))


def _json_object(text: str) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object, or None (not JSON, or JSON of another type)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _decided_len(seg: str, marker: str) -> int:
    """How much of ``seg`` (content at the end of the text so far) is content for sure: not a partial
    ``marker`` at its end, nor the whitespace before one (it is markup if a call follows)."""
    end = len(seg)
    for k in range(min(len(marker) - 1, len(seg)), 0, -1):
        if seg.endswith(marker[:k]):
            end -= k
            break
    return len(seg[:end].rstrip(_WS))


_STRUCT_RE = re.compile(r'["{}]')
_STRING_BODY_RE = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # up to the closing quote


def _object_end(
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
            m = _STRING_BODY_RE.match(s, i)
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


class StreamingToolParser:
    """Incremental parsing of one output: ``feed`` each new piece of text, then ``finish``.

    Holds back only what is undecided: a possible start of a call marker at the end of the text (e.g.
    ``"<tool_"``), the whitespace before it, and an open call until it is complete. A call comes out
    as a single delta (id, name, complete arguments) when its text is complete and parses."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._state = _ScanState()
        self._buf = ""
        self._n_calls = 0
        self._done = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        # An open call can only complete when its closing character arrives: skip the rescan (keeps a
        # long call linear instead of quadratic in its length).
        if self._state.wait is not None and self._state.wait not in delta:
            return "", []
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._done:
            return "", []
        self._done = True
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self._state.wait = None
        events, used = self._parser._scan(self._buf, self._state, final)
        self._buf = self._buf[used:]
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for ev in events:
            if isinstance(ev, _Call):
                deltas.append(ToolCallDelta(self._n_calls, new_call_id(), ev.name, ev.arguments))
                self._n_calls += 1
            else:
                content.append(ev)
        return "".join(content), deltas


class ToolParser:
    """A model's tool-call format. Subclasses implement ``_scan``."""

    name: ClassVar[str]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Whole output -> (content outside the calls, None when empty; the calls)."""
        events, _ = self._scan(text, _ScanState(), final=True)
        content = "".join(e for e in events if isinstance(e, str))
        calls = [ToolCall(new_call_id(), e.name, e.arguments) for e in events if isinstance(e, _Call)]
        return content or None, calls

    def stream(self) -> StreamingToolParser:
        return StreamingToolParser(self)

    def _scan(self, buf: str, st: _ScanState, final: bool) -> tuple[list[_Event], int]:
        """Scan ``buf`` (text from a decided position, scanned in state ``st``): the events it
        decides and how many characters they used; ``st`` is updated to that position. With
        ``final`` the text is complete and everything is decided."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Qwen2.5, Hermes)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _scan(self, buf: str, st: _ScanState, final: bool) -> tuple[list[_Event], int]:
        out: list[_Event] = []
        i, n = 0, len(buf)
        while i < n:
            if st.after_call:  # the newline(s) between or after blocks
                j = i
                while j < n and buf[j] in _WS:
                    j += 1
                i = j
                if i == n:
                    break
                st.after_call = False
            k = buf.find(self.OPEN, i)
            if k == -1:
                keep = n - i if final else _decided_len(buf[i:], self.OPEN)
                out.append(buf[i : i + keep])
                return _nonempty(out), i + keep
            pre = buf[i:k]
            body_start = k + len(self.OPEN)
            e = buf.find(self.CLOSE, body_start)
            if e == -1:
                if not final:  # an open block: wait for its end (the whitespace before it waits too)
                    keep = len(pre.rstrip(_WS))
                    out.append(pre[:keep])
                    st.wait = self.CLOSE[-1]
                    return _nonempty(out), i + keep
                # the output ended inside the block (a stop string, max tokens): a call if it parses
                body, end = buf[body_start:], n
            else:
                body, end = buf[body_start:e], e + len(self.CLOSE)
            call = _decode_call(body, ("arguments", "parameters"), args_required=False)
            if call is None:
                out.append(buf[i:end])  # not a call: all of it is content
            else:
                out += [pre.rstrip(_WS), call]
                st.after_call = True
            i = end
        return _nonempty(out), n


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: ``{"name": ..., "parameters": {...}}`` as the whole answer
    (``;``-separated for several), or after ``<|python_tag|>``, which may follow prose."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _candidate(self, buf: str, j: int, st: _ScanState, final: bool) -> tuple[str, int, _Call | None]:
        """Judge a possible call starting at ``buf[j]`` (a ``{`` or the python tag): ("hold", 0,
        None) when more text is needed, ("open", 0, None) when that text is the rest of an open
        object; ("call", end, call); ("content", end, None) when ``buf[j:end]`` is content; ("none",
        j, None) when nothing starts here."""
        n = len(buf)
        p = j
        if buf.startswith(self.TAG, j):
            p = j + len(self.TAG)
            while p < n and buf[p] in _WS:
                p += 1
            if p == n:
                return ("content", n, None) if final else ("hold", 0, None)
            if buf[p] != "{":
                return "content", j + len(self.TAG), None
        elif buf[j] != "{":
            if not final and self.TAG.startswith(buf[j:]):
                return "hold", 0, None
            return "none", j, None
        # Only the first candidate of a scan can be the object left open by the last one.
        end, st.open_object = _object_end(buf, p, st.open_object)
        if end is None:
            return ("content", n, None) if final else ("open", 0, None)
        st.open_object = None
        call = _decode_call(buf[p:end], ("parameters", "arguments"), args_required=True)
        return ("call", end, call) if call is not None else ("content", end, None)

    def _scan(self, buf: str, st: _ScanState, final: bool) -> tuple[list[_Event], int]:
        out: list[_Event] = []
        i, n = 0, len(buf)
        while i < n:
            if st.at_start:  # a bare '{' may open a call here
                seps = _WS + ";" if st.after_call else _WS
                j = i
                while j < n and buf[j] in seps:
                    j += 1
                if st.after_call:  # separators after a call are markup, whatever follows
                    i = j
                if j == n:
                    if not final:
                        return _nonempty(out), i
                    out.append(buf[i:])
                    return _nonempty(out), n
                verdict, end, call = self._candidate(buf, j, st, final)
                if verdict in ("hold", "open"):
                    st.wait = "}" if verdict == "open" else None
                    return _nonempty(out), i
                if verdict == "call":
                    assert call is not None
                    out.append(call)
                    st.after_call = True
                    i = end
                    continue
                st.at_start = st.after_call = False
                if verdict == "content":
                    out.append(buf[i:end])
                    i = end
                continue
            k = buf.find(self.TAG, i)
            if k == -1:
                keep = n - i if final else _decided_len(buf[i:], self.TAG)
                out.append(buf[i : i + keep])
                return _nonempty(out), i + keep
            pre = buf[i:k]
            verdict, end, call = self._candidate(buf, k, st, final)
            if verdict in ("hold", "open"):
                st.wait = "}" if verdict == "open" else None
                keep = len(pre.rstrip(_WS))
                out.append(pre[:keep])
                return _nonempty(out), i + keep
            if verdict == "call":
                assert call is not None
                out += [pre.rstrip(_WS), call]
                st.at_start = st.after_call = True
            else:
                out.append(buf[i:end])
            i = end
        return _nonempty(out), n


def _nonempty(events: list[_Event]) -> list[_Event]:
    return [e for e in events if not isinstance(e, str) or e]


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser for a model's chat template, from the markers its tool rendering uses."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if any(s in chat_template for s in ("<|python_tag|>", "ipython", "Given the following functions")):
        return "llama3_json"
    return None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> what HF chat templates expect: a past call's ``function.arguments``
    as a mapping (templates render it with ``tojson``; a string that is not a JSON object is kept);
    text-part lists joined into a string; a tool result keeps ``tool_call_id`` and gains the called
    function's ``name`` when it has none (some templates show it). Inputs are not modified."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant messages
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                call["function"] = fn
                if isinstance(call.get("id"), str) and isinstance(fn.get("name"), str):
                    names[call["id"]] = fn["name"]
                calls.append(call)
            m["tool_calls"] = calls
        elif m.get("role") == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out
