"""One scheduler request as the gateway tracks it (``SchedulerRequest``: one choice of a client request),
and its rid.

A client request with ``n`` choices (or several prompts) is that many scheduler requests; their
results share one queue of ``Delivery`` items. The scheduler and the detokenizer keep their state
by rid, so each choice's rid is unique across the deployment (``scheduler_rid``) and changes when
the gateway sends it again (``retry_rid``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from radixserve.common.rpc import pb
from radixserve.tokenizer.errors import ApiError
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle
from radixserve.tokenizer.tracing import RequestTrace

Delivery = tuple[int, pb.RequestText | ApiError]  # a choice's index, and its next text or its failure


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: ``seed + index`` wrapped into the signed 64 bits the wire carries (a
    seed near the top of the range is the client's to send; the next choice's must still fit)."""
    return (seed + index + 2**63) % 2**64 - 2**63


def scheduler_rid(rid: str, index: int) -> str:
    """The rid of a request's choice on the scheduler and the detokenizer: the request's id with the
    choice's index, since a request with ``n`` choices (or several prompts) is that many scheduler
    requests, and both services keep their state by rid (unique across the deployment)."""
    return f"{rid}-{index}"


def retry_rid(rid: str) -> str:
    """A re-sent scheduler request's rid: its own, since the pod it left (or the detokenizer, which
    may hold its start) can still know the old one."""
    return f"{rid}.retry"


@dataclass(eq=False, slots=True)
class SchedulerRequest:
    """One scheduler request: a choice of a client request."""

    rid: str  # scheduler_rid(the request's id, index), retry_rid'd per re-send
    index: int
    scheduler: SchedulerHandle
    queue: asyncio.Queue[Delivery]  # shared by a request's choices
    prompt_tokens: int
    prompt_index: int  # which prompt of a multi-prompt request
    request: pb.TokenizedRequest  # what was sent (again, if its scheduler fails before it starts)
    trace: RequestTrace
    submitted: bool = False  # its scheduler accepted it (before that it cannot know it)
    retried: bool = False  # re-sent once already
    released: bool = False  # the client is done with it
    via: object | None = None  # the Deliver stream its results came through (set: the client has text)
    heard_at: float = field(default_factory=time.monotonic)  # submitted, or its last text came
    missing_since: float | None = None  # first lost-response check its scheduler no longer held it
    # What its client has (a failover continues from it: routing/failover.py).
    output_ids: list[int] = field(default_factory=list)  # tokens delivered
    text_chars: int = 0  # characters of their text delivered
    cached_tokens: int = 0  # prompt tokens its first run found cached (the usage keeps this one)
    failovers: int = 0  # times it was continued elsewhere

    def delivered(self, t: pb.RequestText) -> None:
        """``t`` goes to the client: remembered for a failover. A continuation's usage keeps the
        first run's cached tokens (the continuation's own count its delivered tokens as prompt)."""
        if self.failovers:
            t.cached_tokens = self.cached_tokens
        else:
            self.cached_tokens = t.cached_tokens
        self.output_ids.extend(t.token_ids)
        self.text_chars += len(t.text)

    @property
    def streamed(self) -> bool:
        """Its client has seen some of it: it can only go on as a continuation, never start again."""
        return self.via is not None or self.failovers > 0
