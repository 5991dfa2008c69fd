"""A request that goes on from output its client already has: the gateway moved it here because the
pod or the detokenizer serving it died (tokenizer/routing/failover.py).

It runs as if it had generated those tokens here: the token budget and min tokens count them,
penalties see them, a constrained request's grammar is replayed over them, and each seeded draw is
seeded by (seed, output position) (model/sampler.py), so the continuation's draws are the
undisturbed run's from the same position on. Their logprobs were sent with them: placeholders keep
the new tokens' logprobs aligned and are never sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.req import Req, TokenLogprob

if TYPE_CHECKING:
    from radixserve.scheduler.engine import Engine


@dataclass(frozen=True, slots=True)
class Continuation:
    output_ids: tuple[int, ...]  # what the client has
    text_chars: int  # characters of their text the client got (the detokenizer sends on from there)


def continued(req: Req, c: Continuation, engine: Engine) -> None:
    """Give ``req`` (new, its grammar attached) the output its client has; ValueError if it cannot go
    on (nothing left of its budget, a token outside the vocabulary or its grammar)."""
    out = list(c.output_ids)
    if len(out) >= req.sampling.max_new_tokens:
        raise ValueError(f"continuation: {len(out)} output tokens leave nothing of max_new_tokens")
    if out:
        engine.check_vocab(out, SamplingParams())
    if req.grammar is not None:
        for i, t in enumerate(out):
            if not req.grammar.accept(t):
                raise ValueError(f"continuation: output token {i} ({t}) breaks the request's constraint")
    placeholders: list[TokenLogprob] = [(float("nan"), [], [])] * len(out)
    req.output_ids, req.output_logprobs = out, placeholders
