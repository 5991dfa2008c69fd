"""What the OpenAI endpoints say about each choice as its deliveries come (pure: no I/O).

One state object per choice turns each delivery (session.Output) into what a chunk, or the final
body, shows of it: completions prepend the echoed prompt to the first, and score its tokens; chats
split off the reasoning (reasoning.py) and pass the answer through the model's tool-call parser, so
calls come out as ``tool_calls`` and only the rest as content. A non-streamed response is the same
steps folded (``CompletionFold``), except that a chat's whole text is parsed at once (``chat_answer``).

Finish reason ``tool_calls``: when a call came out and the model stopped by itself (EOS, a stop
string); a choice cut by max_tokens keeps ``length``, its last call may be the cut one.
``parallel_tool_calls: false``: only the first call is kept (the grammar of a forcing tool_choice
still allows several in the hermes format; later ones are dropped, not shown as text).
Reasoning: in ``reasoning_content`` (message and deltas), as vLLM and SGLang do (OpenAI itself shows
none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.tokenizer.openai_api.bodies import (
    CompletionLogprobs,
    CompletionResult,
    ContentLogprob,
    Pieces,
    TextOffsets,
    ToolCallBody,
    ToolCallDeltaBody,
    chat_logprobs,
    completion_logprobs,
    extend_completion_logprobs,
    no_completion_logprobs,
    scored,
)
from radixserve.tokenizer.session import Output
from radixserve.tokenizer.text.reasoning import ReasoningParser, Split, Start, StreamingReasoning
from radixserve.tokenizer.text.tool_calls import StreamingToolParser, ToolCall, ToolCallDelta, ToolParser


# ---------------------------------------------------------------------------------- completions
class CompletionChoiceState:
    """``logprobs``: the request asked for them; ``echo``: the prompt's text and ids, shown first."""

    def __init__(self, pieces: Pieces, logprobs: bool, echo: tuple[str, Sequence[int]] | None = None) -> None:
        self._pieces = pieces
        self._logprobs = logprobs
        self._echo = echo
        self._offsets = TextOffsets()

    def step(self, o: Output) -> tuple[str, CompletionLogprobs | None]:
        """The delivery's text (after the echoed prompt, the first time) and its tokens' logprobs
        (None when not asked, or when it brought no tokens and no prompt scores)."""
        text, lp = o.text, None
        if self._echo is not None:
            text, lp = self._echoed(o)
        if self._logprobs and o.logprobs is not None and o.token_ids:
            more = completion_logprobs(scored(o.token_ids, o.logprobs), self._pieces, self._offsets)
            if lp is None:
                lp = more
            else:
                extend_completion_logprobs(lp, more)
        return text, lp

    def _echoed(self, o: Output) -> tuple[str, CompletionLogprobs | None]:
        assert self._echo is not None
        (prompt, ids), self._echo = self._echo, None
        lp = None
        if self._logprobs and o.prompt_logprobs is not None:
            # Offsets within the prompt come from its tokens' own bytes; the completion's start
            # after the echoed text, whatever it is (a BOS token shows in tokens, not in the text).
            lp = completion_logprobs(scored(ids, o.prompt_logprobs), self._pieces, TextOffsets())
        self._offsets = TextOffsets(start=len(prompt))
        return prompt + o.text, lp


@dataclass(slots=True)
class CompletionFold:
    """A non-streamed completion's choices, built from the steps of each."""

    states: list[CompletionChoiceState]
    logprobs: bool
    results: list[CompletionResult] = field(default_factory=list)
    _texts: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._texts = [[] for _ in self.states]
        self.results = [
            CompletionResult(i, "", None, no_completion_logprobs() if self.logprobs else None)
            for i in range(len(self.states))
        ]

    def add(self, o: Output) -> None:
        text, lp = self.states[o.index].step(o)
        r = self.results[o.index]
        self._texts[o.index].append(text)
        r.finish_reason = o.finish_reason
        if lp is not None and r.logprobs is not None:
            extend_completion_logprobs(r.logprobs, lp)

    def done(self) -> list[CompletionResult]:
        for r, texts in zip(self.results, self._texts, strict=True):
            r.text = "".join(texts)
        return self.results


# ----------------------------------------------------------------------------------------- chat
@dataclass(frozen=True, slots=True)
class ChatParsing:
    """How a chat's output is read: reasoning first (``reasoning``: the server's --reasoning-parser,
    None when off or the request asked ``separate_reasoning: false``), then the answer through the
    tool-call parser (``tools``: when the model may call tools)."""

    tools: ToolParser | None = None
    one_call: bool = False  # parallel_tool_calls: false
    reasoning: ReasoningParser | None = None
    reasoning_start: Start = Start.MAYBE  # where the output begins (ReasoningParser.mode of the prompt)


@dataclass(frozen=True, slots=True)
class ChatStep:
    reasoning: str
    content: str
    tool_calls: list[ToolCallDeltaBody]
    logprobs: list[ContentLogprob] | None
    finish_reason: str | None


class ChatChoiceState:
    """A streamed chat choice, read as ``parsing`` says."""

    def __init__(self, pieces: Pieces, logprobs: bool, parsing: ChatParsing) -> None:
        self._pieces = pieces
        self._logprobs = logprobs
        self._one_call = parsing.one_call
        self._tools: StreamingToolParser | None = parsing.tools.stream() if parsing.tools else None
        self._reasoning: StreamingReasoning | None = (
            parsing.reasoning.stream(parsing.reasoning_start) if parsing.reasoning else None
        )
        self._called = False

    def step(self, o: Output) -> ChatStep:
        reasoning, content = "", o.text
        if self._reasoning is not None:
            split = self._reasoning.feed(o.text)
            if o.finish_reason is not None:
                last = self._reasoning.finish()
                split = Split(split.reasoning + last.reasoning, split.content + last.content)
            reasoning, content = split.reasoning, split.content
        deltas: list[ToolCallDelta] = []
        if self._tools is not None:
            content, deltas = self._tools.feed(content)
            if o.finish_reason is not None:
                rest, more = self._tools.finish()
                content, deltas = content + rest, deltas + more
            deltas = [d for d in deltas if not (self._one_call and d.index > 0)]
            self._called |= bool(deltas)
        lp = None
        if self._logprobs and o.logprobs is not None and o.token_ids:
            lp = chat_logprobs(scored(o.token_ids, o.logprobs), self._pieces)
        reason = finish_reason(o.finish_reason, self._called)
        return ChatStep(reasoning, content, [delta_body(d) for d in deltas], lp, reason)


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def delta_body(d: ToolCallDelta) -> ToolCallDeltaBody:
    body: ToolCallDeltaBody = {"index": d.index}
    if d.id is not None:  # a call's first delta
        body["id"], body["type"] = d.id, "function"
        body["function"] = {"name": d.name or "", "arguments": d.arguments}
    else:
        body["function"] = {"arguments": d.arguments}
    return body


def call_body(c: ToolCall) -> ToolCallBody:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


@dataclass(frozen=True, slots=True)
class ChatAnswer:
    """A whole chat output read as ``ChatParsing`` says."""

    reasoning: str | None
    content: str | None  # None when there is none (the calls are all there is)
    tool_calls: list[ToolCallBody]


def chat_answer(text: str, parsing: ChatParsing) -> ChatAnswer:
    reasoning, content = None, text
    if parsing.reasoning is not None:
        reasoning, answer = parsing.reasoning.parse(text, parsing.reasoning_start)
        content = answer or ""
    if parsing.tools is None:
        return ChatAnswer(reasoning, content if content or reasoning is None else None, [])
    rest, calls = parsing.tools.parse(content)
    if not calls:
        return ChatAnswer(reasoning, content if content or reasoning is None else None, [])
    return ChatAnswer(reasoning, rest, [call_body(c) for c in calls[: 1 if parsing.one_call else None]])
