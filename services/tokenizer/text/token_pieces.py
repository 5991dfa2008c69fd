"""Each token's own text and raw bytes, for logprobs (OpenAI shows every scored token by itself).

Decoding one id at a time with ``tokenizer.decode([id])`` loses bytes: a byte-level BPE token may be
part of a UTF-8 character (one of a CJK character's three bytes), which decodes to U+FFFD, and the
chat API's ``bytes`` must still be that token's true bytes (clients join them to rebuild text). So
the bytes come from the vocabulary itself:

- byte-level BPE (GPT-2, Llama 3, Qwen): the token's symbols map back to bytes through the byte
  alphabet (``Ġ`` is the space byte, ...);
- SentencePiece with byte fallback (Llama 2, Mistral): ``<0xE4>`` is that byte, ``▁`` a space;
- added and special tokens (``<|im_end|>``): their text;
- anything else: ``decode([id])``'s text, as UTF-8.

A token whose bytes are not valid UTF-8 by themselves is shown as ``bytes:\\xe4\\xbd`` (what
OpenAI's legacy completions show for such tokens), so two different partial tokens never print the
same.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SP_SPACE = "\u2581"  # SentencePiece's word-start mark


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: symbol -> the byte it stands for (printable bytes as themselves,
    the others shifted to code points from 256 on, in byte order)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return {s: b for b, s in symbols.items()}


def shown(raw: bytes) -> str:
    """The text OpenAI shows for a token: its UTF-8, or its bytes spelled out when they are not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenPieces:
    """``piece(id)``: (shown text, raw bytes) of one token of ``tokenizer`` (a transformers tokenizer),
    cached: a response shows the same tokens again and again."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._kind = _decoder_kind(tokenizer)
        self._added: dict[int, str] = {
            i: str(t.content) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        }
        self._cache: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> tuple[str, bytes]:
        got = self._cache.get(token_id)
        if got is None:
            raw = self._raw(token_id)
            got = self._cache[token_id] = (shown(raw), raw)
        return got

    def _raw(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        symbol = self._tok.convert_ids_to_tokens(token_id)
        if not isinstance(symbol, str):  # outside the vocabulary (a model wider than its tokenizer)
            return b""
        if self._kind == "byte_level":
            alphabet = byte_alphabet()
            if all(c in alphabet for c in symbol):
                return bytes(alphabet[c] for c in symbol)
        elif self._kind == "sentencepiece":
            m = _SP_BYTE.fullmatch(symbol)
            return bytes([int(m.group(1), 16)]) if m else symbol.replace(_SP_SPACE, " ").encode("utf-8")
        return str(self._tok.decode([token_id])).encode("utf-8")  # no vocabulary bytes to read


def _decoder_kind(tokenizer: Any) -> str:
    """ "byte_level", "sentencepiece" or "other", from a fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "other"
    try:
        state = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return "other"
    kinds = _kinds(state)
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    return "other"


def _kinds(state: object) -> set[str]:
    """Every decoder type named in a decoder's state (a Sequence nests others)."""
    if isinstance(state, dict):
        out = {str(state["type"])} if "type" in state else set()
        for v in state.values():
            out |= _kinds(v)
        return out
    if isinstance(state, list):
        return set().union(*(_kinds(v) for v in state)) if state else set()
    return set()
