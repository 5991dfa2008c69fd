"""The gateway's side of the model's text: its tokenizer and chat template, each token's own text for
logprobs, the tool-call format of its template, and the check of structured-output constraints.

The Gateway holds one (``gw.text``; ``gw.encode`` is its ``encode``). Nothing here talks
to another service.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.common.sampling import Constraint
from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.token_pieces import TokenPieces
from radixserve.tokenizer.tool_calls import PARSERS, parser_for_template, template_messages

if TYPE_CHECKING:
    from radixserve.scheduler.grammar import GrammarBackend

log = logging.getLogger(__name__)


def _template_role(message: Mapping[str, object]) -> dict[str, object]:
    """``message`` with OpenAI's ``developer`` role as ``system``: it replaces system for newer OpenAI
    models, and chat templates (ChatML's among them) know no developer role."""
    m = dict(message)
    if m.get("role") == "developer":
        m["role"] = "system"
    return m


class ModelText:
    def __init__(self, model_path: str | Path, tool_call_parser: str | None = None) -> None:
        """``tool_call_parser``: the tool-call format (tool_calls.PARSERS); None: the one the chat
        template shows, if any (then requests with tools are refused)."""
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(
            str(model_path)
        )  # a fast one (llguidance needs it)
        self.vocab_size = len(self.tokenizer)  # what a client's token ids are checked against
        self.pieces = TokenPieces(self.tokenizer)
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r} (known: {', '.join(PARSERS)})")
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_call_parser = tool_call_parser or parser_for_template(
            template if isinstance(template, str) else None
        )
        log.info("tool calls: %s", self.tool_call_parser or "none (the chat template shows no known format)")
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        tools: list[dict[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """OpenAI-shaped messages (and tools) through the chat template, with the generation prompt
        unless ``add_generation_prompt`` is False (/v1/tokenize's option)."""
        if not messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                template_messages([_template_role(m) for m in messages]),
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # the template's own checks (roles, order) raise
            raise ApiError(400, f"messages do not fit the chat template: {e}", param="messages") from e
        # The template writes its special tokens as text; adding them again would double the BOS.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def check_constraint(self, c: Constraint, param: str) -> None:
        """A 400 naming ``param`` with llguidance's reason when ``c`` cannot be enforced.

        Through the backend's compile cache (per kind and spec): a schema every request repeats is
        validated once, then it costs a lookup (a bad one's failure is cached too). Off the event loop:
        a large schema takes a while to compile, and every stream waits while the loop is busy."""
        from radixserve.scheduler.grammar import GrammarError

        backend = self._grammar
        if backend is None:  # its first build (llguidance's view of the vocabulary) is slow too
            backend = await asyncio.to_thread(self._grammar_backend)
        compiled = backend.compile(c)  # a cached future, or the work queued on the backend's pool
        try:
            # Shielded: a client leaving mid-wait must not cancel a future other requests share.
            await asyncio.shield(asyncio.wrap_future(compiled))
        except GrammarError as e:
            raise ApiError(400, f"{param}: {e}", param=param) from e

    def _grammar_backend(self) -> GrammarBackend:
        """Made on first use: llguidance's view of the vocabulary takes a moment to build, and most
        gateways never see a constraint. The model's own vocab width does not matter to a check."""
        from radixserve.scheduler.grammar import GrammarBackend

        with self._grammar_lock:
            if self._grammar is None:
                eos = self.tokenizer.eos_token_id
                self._grammar = GrammarBackend(
                    self.tokenizer, self.vocab_size, [eos if eos is not None else 0], threads=1
                )
            return self._grammar
