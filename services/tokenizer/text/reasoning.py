"""Reasoning output: a thinking model's ``<think>...</think>`` as ``reasoning_content``, the rest as the
answer (``content``), whole or streamed (``--reasoning-parser``).

Two parsers, one behaviour each:

* ``qwen3`` (Qwen3, QwQ): the output starts in the answer unless it opens ``<think>``, or the prompt
  already did (the chat template of a thinking-only model ends the prompt with ``<think>``);
* ``deepseek_r1`` (DeepSeek-R1 and its distills): the output starts in the reasoning, with or without
  a ``<think>`` of its own (R1 writes none, R1-0528 does).

The reasoning ends at ``</think>``; the whitespace right after it is the template's markup and is
dropped. An output that ends inside the reasoning (max_tokens) is all reasoning. Anything else is
the answer verbatim, which is what tool-call parsing and structured outputs then apply to.

Whether the prompt opened the reasoning, or closed it (a thinking switch turned off renders an
empty ``<think></think>`` there), is ``ReasoningParser.mode``'s to read from the rendered prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

_WS = " \t\r\n"


class Start(Enum):
    """Where the output begins, read from the prompt (``ReasoningParser.mode``)."""

    INSIDE = "inside"  # the prompt opened <think>: the output is reasoning until </think>
    MAYBE = "maybe"  # the output may open <think> itself (qwen3), or starts inside anyway (deepseek_r1)
    ANSWER = "answer"  # the prompt closed an empty <think></think>: there is no reasoning


@dataclass(frozen=True, slots=True)
class Split:
    """What one piece of output (or a whole output) is: reasoning and answer text."""

    reasoning: str
    content: str


class ReasoningParser:
    name: ClassVar[str]
    START: ClassVar[str] = "<think>"
    END: ClassVar[str] = "</think>"
    STARTS_INSIDE: ClassVar[bool]  # MAYBE means inside (the model may skip its own <think>)

    @classmethod
    def mode(cls, prompt: str) -> Start:
        """Where an output after ``prompt`` (the rendered chat prompt) begins."""
        tail = prompt.rstrip(_WS)
        if tail.endswith(cls.START):
            return Start.INSIDE
        if tail.endswith(cls.END):
            return Start.ANSWER
        return Start.MAYBE

    def grammar_head(self, start: Start, tag_term: Callable[[str], str | None]) -> tuple[str, str] | None:
        """What a structured-output constraint must let through before the answer, as a Lark
        expression and the rules it uses (grammar.after_prefix), or None when there is no reasoning
        to let through. ``tag_term``: a tag's Lark term when it is a single token of the vocabulary
        (``<[id]>``), else None (then it is matched as text)."""
        if start is Start.ANSWER:
            return None
        open_, close = tag_term(self.START), tag_term(self.END)
        open_term = open_ if open_ is not None else json.dumps(self.START)
        if close is not None:  # a token: text cannot hold it, so free text stops where it comes
            body, rules = f"/(?s:.*)/ {close}", ""
        else:  # text: the free text is lazy, up to the first end tag
            body, rules = "think", f"think[suffix={json.dumps(self.END)}]: /(?s:.*)/\n"
        ws = "/[ \\t\\r\\n]*/"
        if start is Start.INSIDE:
            return f"{body} {ws}", rules
        if self.STARTS_INSIDE:
            return f"{open_term}? {body} {ws}", rules
        return f"({open_term} {body} {ws})?", rules

    def stream(self, start: Start) -> StreamingReasoning:
        return StreamingReasoning(self, start)

    def parse(self, text: str, start: Start) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content), None for an empty part."""
        s = self.stream(start)
        a, b = s.feed(text), s.finish()
        reasoning, content = a.reasoning + b.reasoning, a.content + b.content
        return reasoning or None, content or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    STARTS_INSIDE = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    STARTS_INSIDE = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


class StreamingReasoning:
    """One output, fed piece by piece. Holds back only what is undecided: a possible start of a tag
    at the end of the text, and the whitespace after ``</think>`` until the answer's first character."""

    def __init__(self, parser: ReasoningParser, start: Start) -> None:
        self._p = parser
        inside = start is Start.INSIDE or (start is Start.MAYBE and parser.STARTS_INSIDE)
        # before: the output may still open <think> (only at its very start, after whitespace)
        self._phase = "answer" if start is Start.ANSWER else "before" if start is Start.MAYBE else "inside"
        self._inside_default = inside
        self._buf = ""
        self._done = False

    def feed(self, text: str) -> Split:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._run(final=False)

    def finish(self) -> Split:
        if self._done:
            return Split("", "")
        self._done = True
        return self._run(final=True)

    def _run(self, final: bool) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        start, end = self._p.START, self._p.END
        while self._buf:
            buf = self._buf
            if self._phase == "before":
                lead = buf.lstrip(_WS)
                if lead.startswith(start):
                    self._buf, self._phase = lead[len(start) :], "inside"
                    continue
                if not final and start.startswith(lead):  # "" or a prefix of <think>: wait
                    break
                self._phase = "inside" if self._inside_default else "answer"
                continue
            if self._phase == "inside":
                k = buf.find(end)
                if k >= 0:
                    reasoning.append(buf[:k])
                    self._buf, self._phase = buf[k + len(end) :], "after_end"
                    continue
                keep = len(buf) if final else len(buf) - _partial_len(buf, end)
                reasoning.append(buf[:keep])
                self._buf = buf[keep:]
                break
            if self._phase == "after_end":  # whitespace after </think> is markup
                lead = buf.lstrip(_WS)
                if not lead and not final:
                    break
                self._buf, self._phase = lead, "answer"
                continue
            content.append(buf)
            self._buf = ""
        return Split("".join(reasoning), "".join(content))


def _partial_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
