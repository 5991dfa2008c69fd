"""OpenAI tool calls for ``/v1/chat/completions``: parse the model's text back into ``tool_calls``,
as a whole or streamed, and shape messages for the chat template.

The model never sees OpenAI's JSON: the model folder's chat template renders ``tools`` (and past calls
and tool results) in the model's own format, and the model answers in that format. Two formats are
understood, picked from the template text (``parser_for_template``):

* ``hermes`` (Qwen2.5/3, Hermes, the demo model's ChatML template): each call is a block
  ``<tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call>`` anywhere in the output;
* ``llama3_json`` (Llama 3.1/3.2 with JSON tool calling): the output *is* the call,
  ``{"name": "N", "parameters": {...}}`` (several may follow each other, ``;``-separated), optionally
  after a ``<|python_tag|>`` marker, which may also follow some prose.

Streaming: a call's id and name go out as soon as the name is known (hermes: its ``"name"`` string
has closed inside a block; llama3_json: the ``"parameters"`` key follows it, since a bare JSON answer
may also have a name), then its arguments as the model writes them, character for character. From
that point it is a call, whatever follows: a call cut by max_tokens ends with the arguments written
so far, and malformed arguments are kept as written (OpenAI documents that arguments may not be
valid JSON). Before it, text that turns out not to be a call (no name, bad JSON, a JSON answer)
stays content verbatim; a hermes block cut before its name is dropped (it was never a call, and its
markup is not an answer). Call forms that cannot stream (arguments before the name, arguments
double-encoded as a JSON string) come out whole when the call is complete.

Whitespace touching a call is the format's markup (the newline before ``<tool_call>``, the ``;``
between Llama calls) and is dropped; all other text is content verbatim, so an output with no calls
parses to itself. ``parse`` is the stream fed at once: any chunking of an output gives the same
content and calls.

``tool_choice`` is enforced by a grammar that only these formats' calls match (tool_grammar.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from radixserve.tokenizer.text.tool_call_text import (
    WS,
    CallArgs,
    CallBody,
    CallHead,
    CallOpen,
    Event,
    ScanState,
    held_len,
    merged,
    object_end,
    skip_ws,
    whole_call,
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str  # "call_<24 hex>"
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One streamed piece of a call: OpenAI's ``chat.completion.chunk`` ``delta.tool_calls[i]``."""

    index: int  # which call of this message (0, 1, ...)
    id: str | None  # with the first delta of a call only
    name: str | None  # with the first delta of a call only
    arguments: str  # a fragment of the arguments JSON


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class StreamingToolParser:
    """Incremental parsing of one output: ``feed`` each new piece of text, then ``finish``."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._state = ScanState()
        self._n_calls = 0
        self._done = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._text += delta
        return self._deltas(self._parser._scan(self._text, self._state, final=False))

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._done:
            return "", []
        self._done = True
        return self._deltas(self._parser._scan(self._text, self._state, final=True))

    def _rebase(self) -> None:
        """Drop the decided text (kept while a call body is open: offsets into it are absolute), so a
        long output is not copied whole at every feed."""
        st = self._state
        if st.body is None and st.pos:
            self._text = self._text[st.pos :]
            st.pos = 0

    def _deltas(self, events: list[Event]) -> tuple[str, list[ToolCallDelta]]:
        self._rebase()
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for ev in events:
            if isinstance(ev, CallOpen):
                deltas.append(ToolCallDelta(self._n_calls, new_call_id(), ev.name, ""))
                self._n_calls += 1
            elif isinstance(ev, CallArgs):
                if deltas and deltas[-1].index == self._n_calls - 1:  # one delta per call per feed
                    last = deltas[-1]
                    deltas[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + ev.text)
                else:
                    deltas.append(ToolCallDelta(self._n_calls - 1, None, None, ev.text))
            else:
                content.append(ev)
        return "".join(content), deltas


class ToolParser:
    """A model's tool-call format. Subclasses implement ``_scan``."""

    name: ClassVar[str]
    ARGS_KEYS: ClassVar[tuple[str, ...]]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Whole output -> (content outside the calls, None when empty; the calls)."""
        s = self.stream()
        content, deltas = s.feed(text)
        more, last = s.finish()
        calls: list[list[str]] = []
        for d in [*deltas, *last]:
            if d.id is not None:
                calls.append([d.id, d.name or "", d.arguments])
            else:
                calls[d.index][2] += d.arguments
        return (content + more) or None, [ToolCall(i, n, a) for i, n, a in calls]

    def stream(self) -> StreamingToolParser:
        return StreamingToolParser(self)

    def _scan(self, text: str, st: ScanState, final: bool) -> list[Event]:
        """Decide what can be decided of ``text`` (everything, with ``final``) from ``st.pos`` on;
        returns the new events. Only ever looks at ``text[:len(text)]`` as it is: a decision made
        on a prefix is never taken back."""
        raise NotImplementedError

    def _content_to_marker(self, text: str, st: ScanState, marker: str, final: bool) -> int | None:
        """Emit the content before the next ``marker`` and return where the marker starts, the
        whitespace before it held back (markup if a call follows); None when there is none: the
        content is emitted up to what may still become one."""
        k = text.find(marker, st.pos)
        if k == -1:
            keep = len(text) if final else len(text) - held_len(text[st.pos :], marker)
            if keep > st.pos:
                st.events.append(text[st.pos : keep])
                st.pos = keep
            return None
        kept = len(text[st.pos : k].rstrip(WS))
        if kept:
            st.events.append(text[st.pos : st.pos + kept])
        st.pos += kept
        return k

    # ------------------------------------------------------------------ call bodies (shared)
    def _body(self, text: str, st: ScanState, final: bool, commit_on_name: bool) -> str:
        """Advance ``st.body``: "open" (needs more text), "call" (a call ended at ``st.pos``),
        "content" (not a call: ``text[st.marker_at:st.pos]`` is content), "drop" (cut before it
        could be told: ``st.pos`` at the end, nothing emitted)."""
        b = st.body
        assert b is not None
        if b.phase == "head":
            got, name, at = CallHead.read(text, b.start, self.ARGS_KEYS)
            if name is not None and commit_on_name and not b.opened:
                st.events.append(CallOpen(name))
                b.opened = True
            if got == CallHead.ARGS:
                if not b.opened:
                    st.events.append(CallOpen(name or ""))
                    b.opened = True
                b.phase, b.args_start, b.sent = "args", at, at
            elif got in (CallHead.MORE, CallHead.NAME_MORE):
                if not final:
                    return "open"
                b.phase = "whole"  # cut here: judged as it stands
            else:
                b.phase = "whole"
        if b.phase == "args":
            return self._args(text, st, final)
        if b.phase == "tail":
            return self._tail(text, st, final)
        return self._whole(text, st, final)

    def _args(self, text: str, st: ScanState, final: bool) -> str:
        b = st.body
        assert b is not None
        if b.sent == b.args_start:  # nothing of the value out yet: whitespace before it is markup
            b.args_start = b.sent = skip_ws(text, b.args_start)
        if b.args_start >= len(text):
            if final:
                st.pos = len(text)
                return "call"
            return "open"
        if text[b.args_start] != "{":  # a double-encoded string, or no object: read whole
            b.phase = "whole"
            return self._whole(text, st, final)
        end, b.resume = object_end(text, b.args_start, b.resume)
        upto = len(text) if end is None else end
        if upto > b.sent:
            st.events.append(CallArgs(text[b.sent : upto]))
            b.sent = upto
        if end is None:
            if final:
                st.pos = len(text)
                return "call"
            return "open"
        b.phase, b.args_end, b.resume = "tail", end, None
        return self._tail(text, st, final)

    def _tail(self, text: str, st: ScanState, final: bool) -> str:
        """After the arguments object: up to the call's end (the format's), all markup."""
        b = st.body
        assert b is not None
        end = self._call_end(text, b.args_end)
        if end is None:
            if final:
                st.pos = len(text)
                return "call"
            return "open"
        st.pos = end
        return "call"

    def _whole(self, text: str, st: ScanState, final: bool) -> str:
        """A body that cannot stream: read to its end, then judge it."""
        b = st.body
        assert b is not None
        end = self._whole_end(text, b)
        if end is None and not final:
            return "open"
        stop = len(text) if end is None else end
        body = self._whole_body(text, b, stop)
        events = whole_call(body, self.ARGS_KEYS, args_required=not self.COMMITS_ON_NAME)
        if b.opened:  # its name went out already: a call, whatever its arguments
            args = [e for e in events or [] if isinstance(e, CallArgs)]
            st.events += args or ([] if end is None else [CallArgs("{}")])
            st.pos = stop
            return "call"
        if events is None:
            if end is None and self._drops_cut_bodies(st):
                st.pos = len(text)
                return "drop"
            st.pos = stop
            return "content"
        st.events += events
        st.pos = stop
        return "call"

    COMMITS_ON_NAME: ClassVar[bool]

    def _call_end(self, text: str, args_end: int) -> int | None:
        raise NotImplementedError

    def _whole_end(self, text: str, b: CallBody) -> int | None:
        raise NotImplementedError

    def _whole_body(self, text: str, b: CallBody, stop: int) -> str:
        raise NotImplementedError

    def _drops_cut_bodies(self, st: ScanState) -> bool:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Qwen2.5/3, Hermes)."""

    name = "hermes"
    ARGS_KEYS = ("arguments", "parameters")
    COMMITS_ON_NAME = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _scan(self, text: str, st: ScanState, final: bool) -> list[Event]:
        st.events = []
        n = len(text)
        while True:
            if st.body is not None:
                verdict = self._body(text, st, final, commit_on_name=True)
                if verdict == "open":
                    break
                if verdict == "content":  # the block and the whitespace before it
                    st.events.append(text[st.marker_at : st.pos])
                st.body, st.after_call = None, verdict == "call"
                continue
            if st.after_call:  # the newline(s) between or after blocks
                i = skip_ws(text, st.pos)
                if i == n and not final:
                    break
                st.pos, st.after_call = i, False
            k = self._content_to_marker(text, st, self.OPEN, final)
            if k is None:
                break
            st.marker_at = st.pos  # from here: content again if the block is not a call
            st.pos = k + len(self.OPEN)
            st.body = CallBody(start=st.pos)
        return merged(st.events)

    def _call_end(self, text: str, args_end: int) -> int | None:
        e = text.find(self.CLOSE, args_end)
        return None if e == -1 else e + len(self.CLOSE)

    def _whole_end(self, text: str, b: CallBody) -> int | None:
        return self._call_end(text, b.start)

    def _whole_body(self, text: str, b: CallBody, stop: int) -> str:
        body = text[b.start : stop]
        return body[: -len(self.CLOSE)] if body.endswith(self.CLOSE) else body

    def _drops_cut_bodies(self, st: ScanState) -> bool:
        assert st.body is not None
        return True  # a block cut before it could be read: markup, not an answer


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: ``{"name": ..., "parameters": {...}}`` as the whole answer
    (``;``-separated for several), or after ``<|python_tag|>``, which may follow prose."""

    name = "llama3_json"
    ARGS_KEYS = ("parameters", "arguments")
    COMMITS_ON_NAME = False
    TAG = "<|python_tag|>"

    def _scan(self, text: str, st: ScanState, final: bool) -> list[Event]:
        st.events = []
        n = len(text)
        while True:
            if st.body is not None:
                verdict = self._body(text, st, final, commit_on_name=False)
                if verdict == "open":
                    break
                if verdict == "content":
                    st.events.append(text[st.marker_at : st.pos])
                    st.at_start = st.after_call = False
                else:
                    st.at_start = st.after_call = verdict == "call"
                st.body = None
                continue
            if st.at_start:  # a bare '{' or the tag may open a call here
                seps = WS + ";" if st.after_call else WS
                j = st.pos
                while j < n and text[j] in seps:
                    j += 1
                if st.after_call:  # separators after a call are markup, whatever follows
                    st.pos = j
                if j == n:
                    if final and j > st.pos:
                        st.events.append(text[st.pos :])
                        st.pos = n
                    break
                if text[j] == "{":
                    st.marker_at, st.tagged = st.pos, False
                    st.body = CallBody(start=j)
                    continue
                if text.startswith(self.TAG, j) or (not final and self.TAG.startswith(text[j:])):
                    if not self._open_tagged(text, st, j, final):
                        break
                    continue
                st.at_start = st.after_call = False
                continue
            k = self._content_to_marker(text, st, self.TAG, final)
            if k is None or not self._open_tagged(text, st, k, final):
                break
        return merged(st.events)

    def _open_tagged(self, text: str, st: ScanState, j: int, final: bool) -> bool:
        """At ``j`` the tag starts (or may): open a body after it, or decide the tag is content.
        False: more text is needed."""
        if not text.startswith(self.TAG, j):
            if final:  # a partial tag at the very end: content
                st.events.append(text[st.pos :])
                st.pos = len(text)
                return False
            return False
        p = skip_ws(text, j + len(self.TAG))
        if p == len(text):
            if final:
                st.events.append(text[st.pos :])
                st.pos = len(text)
            return False
        if text[p] != "{":  # the tag without a call: content, and the scan goes on after it
            st.events.append(text[st.pos : j + len(self.TAG)])
            st.pos = j + len(self.TAG)
            st.at_start = st.after_call = False
            return True
        st.marker_at, st.tagged = st.pos, True
        st.body = CallBody(start=p)
        return True

    def _call_end(self, text: str, args_end: int) -> int | None:
        e = text.find("}", args_end)
        return None if e == -1 else e + 1

    def _whole_end(self, text: str, b: CallBody) -> int | None:
        end, b.resume = object_end(text, b.start, b.resume)
        return end

    def _whole_body(self, text: str, b: CallBody, stop: int) -> str:
        return text[b.start : stop]

    def _drops_cut_bodies(self, st: ScanState) -> bool:
        return st.tagged  # after the tag, a cut object was meant as a call; a bare one may be an answer


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
