"""Incremental detokenization of many requests at once, with stop strings.

Per request the text grows as tokens arrive; what has been sent is never taken back, so:

- A token may end inside a multi-byte UTF-8 character (byte-level BPE) and decode to U+FFFD:
  text ending in U+FFFD is held back until the next token completes it (or the request ends).
- Decoding a token alone can drop or add a leading space (SentencePiece's "▁"): each step decodes
  the new tokens together with a few tokens of context before them and keeps only the difference
  (``prefix_offset`` .. ``read_offset`` is that context).
- A stop string cuts the text where it starts (or, with ``include_stop``, where it ends) and ends
  the request; text that ends in a partial match (a proper prefix of a stop string) is held back
  until it is settled. Before ``min_tokens`` output tokens no stop string is looked for (vLLM's
  min_tokens: the text of those tokens goes out as it is).
- A request continued from output its client already has (the gateway moved it after a scheduler or
  detokenizer died) arrives with those tokens and how much of their text was sent: its state is
  rebuilt from them (text, offsets, a held-back partial stop string), and the text goes on from the
  first character the client has not seen.

All requests of one batch are decoded with two ``batch_decode`` calls per skip_special_tokens
setting, not two calls per request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.common.sampling import find_stop

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # decoded again with a rebuilt request's next tokens (their leading space)
LOST_START = (
    "the detokenizer never saw this request's start (it restarted mid-request?): its text cannot be"
    " rebuilt; retry the request"
)


class Tokenizer(Protocol):
    """What detokenizing needs of a Hugging Face tokenizer: decoding many sequences in one call."""

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = ...) -> list[str]: ...


@dataclass(slots=True)
class DecodeState:
    rid: str
    reply_to: str
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    prompt_tokens: int = 0
    cached_tokens: int = 0
    include_stop: bool = False
    min_tokens: int = 0
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # first token of the context decoded with the new tokens
    read_offset: int = 0  # tokens up to here are in ``text``
    text: str = ""  # decoded text so far (cut at a stop string)
    sent: int = 0  # characters of ``text`` already sent


@dataclass(slots=True)
class TextDelta:
    """What one request gets out of one batch."""

    rid: str
    reply_to: str
    text: str
    token_ids: list[int]
    finish_reason: str = ""
    error: str = ""
    matched_stop: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ended_early: bool = False  # ended here while the scheduler may still run it
    lost_start: bool = False  # its start never came here: no text of it left this detokenizer
    # Passed through untouched (pb.Logprobs): the gateway formats them.
    logprobs: object | None = None
    prompt_logprobs: object | None = None


@dataclass(slots=True)
class RequestTokens:
    """One request's entry of a TokenBatch (pb.RequestTokens), in plain Python: what the scheduler's
    worker.TokenUpdate became on the wire."""

    rid: str
    reply_to: str
    token_ids: list[int]
    finish_reason: str = ""
    error: str = ""
    # first entry of a request only:
    stop: tuple[str, ...] | None = None
    skip_special_tokens: bool = True
    prompt_tokens: int = 0
    cached_tokens: int = 0
    include_stop: bool = False
    min_tokens: int = 0
    continued_ids: list[int] | None = None  # output the client already has (a moved request)
    continued_chars: int = 0  # characters of its text the client got
    logprobs: object | None = None  # pb.Logprobs of token_ids, passed through
    prompt_logprobs: object | None = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, max_finished_memory: int = 100_000) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}
        # Requests ended here by a stop string while their scheduler may still send tokens until
        # the gateway's abort lands: those tokens are dropped. Forgotten at the scheduler's final
        # entry, or the oldest first beyond the bound.
        self._stopped: OrderedDict[str, None] = OrderedDict()
        self._max_finished = max_finished_memory

    def process(self, updates: list[RequestTokens]) -> list[TextDelta]:
        """One delta per update, in order; none for an update dropped after its request's stop string.

        A request named twice in ``updates`` is taken in order, as if the second entry came in a later
        call (decoding one state twice in one batch would append its new text twice)."""
        out: list[TextDelta] = []
        start, seen = 0, set[str]()
        for i, u in enumerate(updates):
            if u.rid in seen:
                out += self._process(updates[start:i])
                start, seen = i, set()
            seen.add(u.rid)
        return out + self._process(updates[start:])

    def _process(self, updates: list[RequestTokens]) -> list[TextDelta]:
        todo: list[tuple[DecodeState | None, RequestTokens]] = []  # None: its start was never seen
        for u in updates:
            if u.rid in self._stopped:
                if u.finish_reason:
                    del self._stopped[u.rid]
                continue
            st = self.states.get(u.rid)
            if st is None and u.stop is None:
                # Not the request's first entry (that one carries its options), yet no state: this
                # detokenizer never saw its start (it restarted, or the start was lost on the way).
                # Its text cannot be rebuilt here: end it with an error the client sees, and drop
                # the rest of its tokens until the scheduler's final entry.
                todo.append((None, u))
                continue
            if st is None:
                st = DecodeState(u.rid, u.reply_to)
                if u.stop is not None:
                    st.stop, st.skip_special_tokens = u.stop, u.skip_special_tokens
                    st.prompt_tokens, st.cached_tokens = u.prompt_tokens, u.cached_tokens
                    st.include_stop, st.min_tokens = u.include_stop, u.min_tokens
                if u.continued_ids:
                    self._rebuild(st, u.continued_ids, u.continued_chars)
                self.states[u.rid] = st
            st.ids.extend(u.token_ids)
            todo.append((st, u))
        for skip in (True, False):
            group = [
                st
                for st, _ in todo
                if st is not None and st.skip_special_tokens is skip and st.read_offset < len(st.ids)
            ]
            if group:
                self._decode(group, skip)
        return [self._lost(u) if st is None else self._delta(st, u) for st, u in todo]

    def _rebuild(self, st: DecodeState, ids: list[int], sent_chars: int) -> None:
        """``st`` as it was after ``ids``, ``sent_chars`` of its text sent: what was held back then (a
        partial stop string, an unfinished character) goes out once settled, nothing twice."""
        st.ids = list(ids)
        decode = self.tokenizer.batch_decode
        end = len(ids)  # the longest run of the tokens that decodes to whole characters
        while end > 0:
            (text,) = decode([st.ids[:end]], skip_special_tokens=st.skip_special_tokens)
            if not text.endswith(_REPLACEMENT):
                break
            end -= 1
        st.text = text if end else ""
        # the next tokens decode with a few tokens before them (a leading space depends on them)
        st.prefix_offset, st.read_offset = max(0, end - _CONTEXT_TOKENS), end
        st.sent = min(sent_chars, len(st.text))

    def _lost(self, u: RequestTokens) -> TextDelta:
        early = not u.finish_reason
        if early:
            self._drop_rest(u.rid)
        return TextDelta(
            u.rid, u.reply_to, "", list(u.token_ids), "abort", LOST_START, ended_early=early, lost_start=True
        )

    def _decode(self, group: list[DecodeState], skip: bool) -> None:
        decode = self.tokenizer.batch_decode
        before = decode([st.ids[st.prefix_offset : st.read_offset] for st in group], skip_special_tokens=skip)
        after = decode([st.ids[st.prefix_offset :] for st in group], skip_special_tokens=skip)
        for st, old, new in zip(group, before, after, strict=True):
            if len(new) > len(old) and not new.endswith(_REPLACEMENT):
                st.text += new[len(old) :]
                st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    def _flush(self, st: DecodeState) -> None:
        """The request ended: what is held back for an incomplete character goes out as it is."""
        if st.read_offset < len(st.ids):
            old, new = self.tokenizer.batch_decode(
                [st.ids[st.prefix_offset : st.read_offset], st.ids[st.prefix_offset :]],
                skip_special_tokens=st.skip_special_tokens,
            )
            st.text += new[len(old) :]
            st.read_offset = len(st.ids)

    def _delta(self, st: DecodeState, u: RequestTokens) -> TextDelta:
        finish, matched = u.finish_reason, ""
        if finish:
            self._flush(st)
        stops = st.stop if len(st.ids) > st.min_tokens else ()
        if stops:
            cut, matched = find_stop(st.text, stops, max(0, st.sent - max(map(len, stops)) + 1))
            if matched:
                st.text, finish = st.text[: cut + len(matched) if st.include_stop else cut], "stop"
        end = len(st.text) if finish else len(st.text) - _partial_stop_len(st.text, stops)
        end = max(end, st.sent)
        out = TextDelta(
            st.rid,
            st.reply_to,
            st.text[st.sent : end],
            list(u.token_ids),
            finish,
            u.error if finish == u.finish_reason else "",
            matched,
            st.prompt_tokens,
            len(st.ids),
            st.cached_tokens,
            ended_early=bool(matched) and not u.finish_reason,
            logprobs=u.logprobs,
            prompt_logprobs=u.prompt_logprobs,
        )
        st.sent = end
        if finish:
            del self.states[st.rid]
            if out.ended_early:
                self._drop_rest(st.rid)
        return out

    def _drop_rest(self, rid: str) -> None:
        """Ended here, not yet by the scheduler: drop its later entries up to the scheduler's final."""
        self._stopped[rid] = None
        while len(self._stopped) > self._max_finished:
            self._stopped.popitem(last=False)


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
