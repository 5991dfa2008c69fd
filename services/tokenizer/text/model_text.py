"""The gateway's side of the model's text: its tokenizer and chat template, each token's own text for
logprobs, the tool-call format of its template, its reasoning format (--reasoning-parser), and the
check of structured-output constraints.

The Gateway holds one (``gw.text``; ``gw.encode`` is its ``encode``). Nothing here talks
to another service.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.common.sampling import Constraint
from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.text.reasoning import REASONING_PARSERS, ReasoningParser
from radixserve.tokenizer.text.token_pieces import TokenPieces
from radixserve.tokenizer.text.tool_calls import PARSERS, parser_for_template, template_messages

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


# apply_chat_template's own parameters: chat_template_kwargs may not set them (they are fields of
# the request, or not the client's to choose).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ChatRender:
    """How a chat's messages become its prompt, besides the messages and tools."""

    add_generation_prompt: bool = True  # the assistant turn's opening
    continue_final_message: bool = False  # the last message stays open for the model to continue
    variables: Mapping[str, object] = field(default_factory=dict)  # chat_template_kwargs


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file holding the template, or the template itself (vLLM's rule)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a template too long to be a file name
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template either")


class ModelText:
    def __init__(
        self,
        model_path: str | Path,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        """``tool_call_parser``: the tool-call format (tool_calls.PARSERS); None: the one the chat
        template shows, if any (then requests with tools are refused). ``reasoning_parser``:
        reasoning.REASONING_PARSERS' (None: reasoning stays in content). ``chat_template``: replaces
        the model folder's (load_chat_template)."""
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(
            str(model_path)
        )  # a fast one (llguidance needs it)
        self.vocab_size = len(self.tokenizer)  # what a client's token ids are checked against
        self.pieces = TokenPieces(self.tokenizer)
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r} (known: {', '.join(PARSERS)})")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            known = ", ".join(REASONING_PARSERS)
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: {known})")
        self.reasoning: ReasoningParser | None = (
            REASONING_PARSERS[reasoning_parser]() if reasoning_parser is not None else None
        )
        if chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(chat_template)
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_call_parser = tool_call_parser or parser_for_template(
            template if isinstance(template, str) else None
        )
        log.info("tool calls: %s", self.tool_call_parser or "none (the chat template shows no known format)")
        log.info("reasoning: %s", reasoning_parser or "not separated (--reasoning-parser is off)")
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        tools: list[dict[str, object]] | None = None,
        render: ChatRender | None = None,
    ) -> str:
        """OpenAI-shaped messages (and tools) through the chat template: the prompt's text."""
        render = render or ChatRender()
        if not messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        if render.continue_final_message and render.add_generation_prompt:
            msg = "continue_final_message needs add_generation_prompt: false (a turn is continued or opened)"
            raise ApiError(400, msg, param="continue_final_message")
        if render.continue_final_message and messages[-1].get("role") != "assistant":
            msg = "continue_final_message needs an assistant message last (the one to continue)"
            raise ApiError(400, msg, param="continue_final_message")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(render.variables))
        if reserved:
            msg = f"chat_template_kwargs.{reserved[0]} is a request field of its own, not a template variable"
            raise ApiError(400, msg, param=f"chat_template_kwargs.{reserved[0]}")
        kwargs: dict[str, Any] = dict(render.variables)
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                template_messages([_template_role(m) for m in messages]),
                add_generation_prompt=render.add_generation_prompt,
                continue_final_message=render.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # the template's own checks (roles, order) raise
            raise ApiError(400, f"messages do not fit the chat template: {e}", param="messages") from e
        return str(text)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        tools: list[dict[str, object]] | None = None,
        render: ChatRender | None = None,
    ) -> list[int]:
        """The chat's prompt (render_chat) as token ids."""
        return self.encode_rendered(self.render_chat(messages, tools, render))

    def encode_rendered(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A rendered chat prompt as token ids. The template writes its special tokens as text: adding
        them again would double the BOS (vLLM's add_special_tokens, off by default for chats)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def tag_term(self, tag: str) -> str | None:
        """``tag`` as a Lark token reference (``<[id]>``) when it is an added token of the vocabulary
        (Qwen3's <think>): llguidance matches those only by id, never as text."""
        tid = self.tokenizer.get_added_vocab().get(tag)
        return f"<[{tid}]>" if isinstance(tid, int) else None

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
