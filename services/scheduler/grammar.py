"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a list of choices or a
Lark grammar, by masking the logits each decode step.

The flow: the gateway prepares a constraint with ``GrammarBackend.compile`` to answer an invalid one
with a 400; the scheduler calls ``compile`` when a request arrives (validation and preparation run on
a small thread pool and are cached per constraint), makes one ``GrammarMatcher`` per request, and each
step writes
the allowed tokens into a packed bitmask (``fill_mask`` / ``fill_masks``), applies it to the logits
(``apply_bitmask``) and advances the matcher with the sampled token (``accept``).

Why llguidance (over xgrammar): a small abi3 wheel with no dependencies (xgrammar pulls triton and
tvm-ffi), full JSON-schema support including string and array length bounds, and masks computed
lazily from the current parser state rather than precompiled per grammar, so preparing a grammar
costs milliseconds and a schema sent once does not stall anything.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from os import PathLike
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from radixserve.common.sampling import CONSTRAINT_KINDS, Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# JSON is generated compact: no whitespace between tokens at all, "," and ":" as separators. With
# llguidance's default (flexible whitespace) a model, and certainly a random-weight one, can spend its
# whole budget on newlines and indentation; compact output is still valid JSON and costs fewer
# tokens. These are llguidance's *defaults*: a schema's own "x-guidance" options override them. A
# Lark grammar's %json{...} does not get them: it should carry
# "x-guidance": {"whitespace_flexible": false} itself.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}

# Errors go to clients (400) and logs: llguidance's verbose form appends the parser state and the
# whole grammar, which is noise there.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """An invalid constraint (bad schema/regex/grammar); the message says why (it goes to the client
    as a 400)."""


def mask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """An int32 CPU bitmask [batch, mask_width(vocab_size)] with every bit set: the rows of
    unconstrained requests allow everything. ``pin_memory`` for an asynchronous copy to a GPU."""
    return torch.full((batch, mask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits`` [B, V] (float, CPU or CUDA) get -inf where ``bitmask`` [B, W] (int32, on the
    same device) has a 0 bit; bit i of word w is token 32*w + i. Columns past 32*W are masked too."""
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"apply_bitmask: logits [B, V] and bitmask [B, W] expected, got "
            f"{tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"apply_bitmask: the bitmask must be int32, got {bitmask.dtype}")
    vocab = logits.shape[1]
    covered = min(vocab, 32 * bitmask.shape[1])
    logits[:, :covered].masked_fill_(_blocked(bitmask, covered), float("-inf"))
    if covered < vocab:
        logits[:, covered:] = float("-inf")


def _blocked(bitmask: torch.Tensor, vocab: int, byteorder: str = sys.byteorder) -> torch.Tensor:
    """bool [B, vocab]: True where the token's bit is 0.

    Plain tensor ops (no torch.compile, no custom kernel) so it runs on any device. The words are
    unpacked byte by byte: viewed as uint8, token 8*k + j is bit j of byte k (in little-endian memory),
    so the temporaries are B*V bytes rather than the 4*B*V of shifting the int32 words 32 ways."""
    rows = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8)
    if byteorder == "big":
        # The bitmask was written by llguidance in the host's byte order; put byte 0 = bits 0..7 first.
        as_bytes = as_bytes.view(rows, -1, 4).flip(-1).reshape(rows, -1)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = as_bytes.unsqueeze(-1) >> shifts
    bits &= 1
    return bits.view(rows, -1)[:, :vocab] == 0


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar (its JSON text) for ``c``. Raises GrammarError when the spec is malformed
    in a way seen before llguidance parses it (not JSON, not a list of strings, an unknown kind);
    errors inside a schema/regex/grammar surface in GrammarBackend.check / compile. A regex is in
    llguidance's (Rust regex) syntax, anchored at both ends; \\d and \\w are Unicode classes."""
    kind, spec = c.kind, c.spec
    try:
        spec.encode("utf-8")
    except UnicodeEncodeError:
        # A JSON request body can carry a lone surrogate ("\ud800"); llguidance takes UTF-8 only.
        raise GrammarError(f"{kind}: the spec is not valid Unicode (a lone surrogate?)") from None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema: the schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema: the schema must be a JSON object, got {type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as e:  # e.g. an "x-guidance" that is not an object
            raise GrammarError(f"json_schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(spec))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    if kind == "llguidance":
        try:
            top = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"llguidance: the grammar is not valid JSON: {e}") from None
        if not isinstance(top, dict) or not isinstance(top.get("grammars"), list):
            raise GrammarError('llguidance: expected {"grammars": [...]}')
        return spec
    raise GrammarError(f"unknown constraint kind {kind!r}: expected one of {', '.join(CONSTRAINT_KINDS)}")


def after_prefix(c: Constraint, head: str, rules: str = "") -> Constraint:
    """``c`` applied only after what the Lark expression ``head`` matches (a reasoning block): one
    llguidance grammar whose start rule is ``head`` followed by ``c``'s grammar (``@answer``);
    ``rules``: Lark rules ``head`` refers to."""
    text = grammar_text(c)
    try:
        top = json.loads(text)
        sub = dict(top["grammars"][0])
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        sub = {"lark_grammar": text}  # Lark text (lark, choice): not JSON
    sub["name"] = "answer"
    start = {"lark_grammar": f"start: {head} @answer\n{rules}"}
    return Constraint("llguidance", json.dumps({"grammars": [start, sub]}, ensure_ascii=False))


def _choice_lark(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"choice: the spec must be a JSON list of strings: {e}") from None
    if not isinstance(choices, list) or not all(isinstance(s, str) for s in choices):
        raise GrammarError("choice: the spec must be a JSON list of strings")
    if not choices:
        raise GrammarError("choice: the list of choices is empty")
    # Lark string literals take JSON's escapes, so json.dumps quotes any string exactly (quotes,
    # backslashes, newlines); ensure_ascii=False keeps non-BMP characters whole instead of writing
    # them as surrogate-pair escapes.
    return "start: " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A validated constraint, ready for matchers: ``template`` is a fresh llguidance matcher (never
    advanced) whose first mask is already computed; each request's matcher is a copy of it, and
    copies share its lexer state."""

    constraint: Constraint
    text: str  # the llguidance grammar
    template: llguidance.LLMatcher = field(repr=False)


def _prepare(tokenizer: llguidance.LLTokenizer, width: int, c: Constraint) -> CompiledGrammar:
    """Runs on the backend's pool: build the grammar and compute its first mask."""
    text = grammar_text(c)
    # The constructor drops the GIL while it builds the grammar (long only for huge grammars).
    m = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=_LIMITS)
    if not m.is_error():
        # The first step builds lexer states that every copy then reuses: do it here, off the engine
        # thread. Some grammars (lexer too complex) only fail at this point.
        scratch = np.empty(width, dtype=np.int32)
        m.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    if m.is_error():
        raise GrammarError(f"invalid {c.kind}: {m.get_error()}")
    return CompiledGrammar(c, text, m)


class GrammarBackend:
    """A model's grammar machinery: llguidance's view of the tokenizer, the compile pool and cache, and
    the mask geometry. One per engine."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        threads: int = 2,
        cache_size: int = 256,
    ) -> None:
        """``tokenizer``: the model folder's fast tokenizer; ``vocab_size``: the model's vocab (the logits'
        width; may exceed the tokenizer's: ids past the tokenizer are never allowed); ``eos_token_ids``:
        the engine's stop tokens, all allowed whenever the grammar accepts and alone once it stopped.
        ``threads``: the compile pool's workers, and fill_masks' parallel mask computation."""
        tok_vocab = len(tokenizer)
        self.vocab_size = vocab_size
        self.width = mask_width(vocab_size)
        self._limit = min(tok_vocab, vocab_size)  # ids at or past it are never allowed
        eos = sorted({int(t) for t in eos_token_ids if 0 <= int(t) < self._limit})
        if len(eos) != len(set(eos_token_ids)):
            logger.warning(
                "grammar: ignoring stop token ids outside the vocab (%d): %s",
                self._limit,
                sorted(set(eos_token_ids) - set(eos)),
            )
        if not eos:
            raise ValueError("GrammarBackend: no stop token id inside the vocab; a grammar could never end")
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._eos_set = frozenset(eos)
        # llguidance's own EOS becomes the engine's stop tokens (the tokenizer's eos_token may be
        # another, e.g. <|endoftext|> where a chat model stops at <|im_end|>): its masks then allow
        # exactly these when accepting, and consume_token takes any of them as the end.
        # Its vocab must cover every tokenizer id; padded to the model's so that a mask row of the
        # logits' width is the size it writes (the padding ids have no bytes: never allowed).
        llg_vocab = max(tok_vocab, vocab_size)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=llg_vocab, eos_token=list(eos))
        self._llg_width = mask_width(llg_vocab)
        # When the tokenizer is wider than the model's rows, llguidance writes a scratch row first.
        self._direct = self._llg_width == self.width
        self._scratch = np.empty(self._llg_width, dtype=np.int32)

        # uint32 views so that bit 31 is an ordinary bit for numpy.
        valid = np.zeros(self.width * 32, dtype=bool)
        valid[: self._limit] = True
        self._valid_row = np.packbits(valid, bitorder="little").view("<u4").astype(np.uint32)
        eos_bits = np.zeros(self.width * 32, dtype=bool)
        eos_bits[list(eos)] = True
        self._eos_row = np.packbits(eos_bits, bitorder="little").view("<u4").astype(np.uint32)

        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._threads = threads
        self._executor: llguidance.LLExecutor | None = None  # made on first batched use
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(
        cls, path: str | PathLike[str], vocab_size: int, eos_token_ids: Sequence[int], **kw: Any
    ) -> GrammarBackend:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise TypeError(
                f"structured outputs need a fast tokenizer, {path} has {type(tokenizer).__name__}"
            )
        return cls(tokenizer, vocab_size, eos_token_ids, **kw)

    def check(self, c: Constraint) -> None:
        """Validate synchronously; raise GrammarError with llguidance's reason. The gateway's 400."""
        text = grammar_text(c)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self._tokenizer, limits=_LIMITS
        )
        if is_error:
            raise GrammarError(f"invalid {c.kind}: {messages[0] if messages else 'rejected by llguidance'}")
        for w in messages:
            logger.debug("grammar warning (%s): %s", c.kind, w)

    def compile(self, c: Constraint) -> concurrent.futures.Future[CompiledGrammar]:
        """Validate and prepare ``c`` on the pool. Futures are cached per (kind, spec) in an LRU of
        ``cache_size``: a repeated constraint gets the same future (done, or still running: the work is
        not repeated). Failures with GrammarError are cached too (the same spec fails the same way, and
        a client resending a costly bad grammar should not cost it again), until evicted; any other
        failure (the pool shut down, out of memory) is dropped from the cache once seen."""
        key = (c.kind, c.spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(_prepare, self._tokenizer, self._llg_width, c)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(partial(self._forget_unexpected, key))
        return fut

    def _forget_unexpected(
        self, key: tuple[str, str], fut: concurrent.futures.Future[CompiledGrammar]
    ) -> None:
        if not fut.cancelled() and isinstance(fut.exception(), GrammarError | None):
            return
        with self._lock:
            if self._cache.get(key) is fut:
                del self._cache[key]

    def matcher(self, g: CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(self, g.template.deep_copy())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _row(self, bitmask: torch.Tensor, row: int) -> np.ndarray:
        """A checked uint32 view of bitmask[row]: llguidance writes through a raw pointer, so the shape
        and memory must be right."""
        if (
            bitmask.dtype != torch.int32
            or bitmask.dim() != 2
            or bitmask.shape[1] != self.width
            or bitmask.device.type != "cpu"
            or not bitmask.is_contiguous()
        ):
            raise ValueError(
                f"grammar bitmask: a contiguous int32 CPU tensor [B, {self.width}] expected, got "
                f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
            )
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"grammar bitmask: row {row} outside [0, {bitmask.shape[0]})")
        words: np.ndarray = bitmask.numpy()[row].view(np.uint32)
        return words

    def _compute(self, m: llguidance.LLMatcher, words: np.ndarray) -> None:
        if self._direct:
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        else:
            m.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
            words[:] = self._scratch[: self.width].view(np.uint32)

    def _finish(self, m: llguidance.LLMatcher, words: np.ndarray) -> None:
        """The engine's rules on top of llguidance's mask (or on an unwritten row, if stopped)."""
        if m.is_stopped():  # complete, or failed (also when computing the mask failed): stop tokens only
            words[:] = self._eos_row
            return
        # llguidance knows nothing past the model's width (a narrower model than tokenizer).
        np.bitwise_and(words, self._valid_row, out=words)
        if m.is_accepting():
            # llguidance already sets its EOS (our stop tokens) here; or-ing them is cheap insurance.
            np.bitwise_or(words, self._eos_row, out=words)


class GrammarMatcher:
    """One request's grammar state; used on the engine thread only."""

    __slots__ = ("_backend", "_m")

    def __init__(self, backend: GrammarBackend, m: llguidance.LLMatcher) -> None:
        self._backend = backend
        self._m = m

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 CPU [B, mask_width(vocab_size)]; bit i
        of word w = token 32*w + i): the grammar's tokens, the stop tokens when it accepts, and only
        the stop tokens once it stopped; never an id past the tokenizer or the model's vocab."""
        b = self._backend
        words = b._row(bitmask, row)
        if not self._m.is_stopped():
            b._compute(self._m, words)
        b._finish(self._m, words)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token. False if the grammar refused it (then ``error`` says why, and
        only stop tokens are allowed from then on); a stop token when accepting ends the output."""
        if token < 0:
            raise ValueError(f"token id {token} is negative")
        if self.done:
            # Complete already: a stop token is still a fine thing to sample (the mask allowed only
            # those), anything else is refused without touching the state.
            return token in self._backend._eos_set
        return bool(self._m.consume_token(token))

    @property
    def done(self) -> bool:
        """True once the output is complete (the grammar admits nothing more, or a stop token was
        accepted): the request finishes with reason 'stop'."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a refused token), or None."""
        if not self._m.is_error():
            return None
        return self._m.get_error() or "refused"


def fill_masks(matchers: Sequence[tuple[int, GrammarMatcher]], bitmask: torch.Tensor) -> None:
    """fill_mask for many (row, matcher) pairs of one backend: the per-step call of the scheduler.
    Several rows are computed in parallel by llguidance's executor (native threads, GIL released)."""
    if not matchers:
        return
    backend = matchers[0][1]._backend
    if len(matchers) == 1 or not backend._direct or any(m._backend is not backend for _, m in matchers):
        for row, m in matchers:
            m.fill_mask(bitmask, row)
        return
    rows = [backend._row(bitmask, row) for row, _ in matchers]  # checks every row before any write
    if len({row for row, _ in matchers}) != len(matchers):
        raise ValueError("fill_masks: a row appears twice")
    if backend._executor is None:
        backend._executor = llguidance.LLExecutor(num_threads=backend._threads)
    live = [(m._m, row) for row, m in matchers if not m._m.is_stopped()]
    if live:
        backend._executor.unsafe_compute_mask_ptr(
            live, bitmask.data_ptr(), backend.width * 4, bitmask.shape[0]
        )
    for words, (_, m) in zip(rows, matchers, strict=True):
        backend._finish(m._m, words)
