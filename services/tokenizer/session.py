"""One client request's life at the gateway, the same for the HTTP and the gRPC front end:

    session = RequestSession(gw, "POST /v1/completions", headers, attributes)
    async with session:                    # however the block ends, the request ends with it
        await session.submit(prompts, sp, n, skip_special_tokens)
        async for outputs in session:      # list[Output]: what each delivery brought, in order
            ...
        session.usage()                    # once every choice has finished

Leaving the block aborts what still runs on the schedulers (the consumer went away, failed, or was
cancelled), counts the request in the metrics and ends its trace. A failed ``submit`` ends the
session too, so a front end may submit before it enters the block (HTTP streaming does: the 200
and its generator come only after a successful submit). Inside the block an unexpected exception
leaves as a 500 ApiError naming the request (logged under its id): front ends handle ApiError only.

One id per request, ``rid``, made here: the OpenAI response id is ``cmpl-<rid>`` / ``chatcmpl-<rid>``,
gRPC Generate's responses carry it, its trace has it (``radixserve.request_id``), an internal error
is logged under it, and its scheduler requests (on the schedulers, the detokenizer and in their
logs) are ``<rid>-<choice index>``, ``.retry`` appended per re-send (choice.scheduler_rid).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from radixserve.common.rpc import pb
from radixserve.common.sampling import SamplingParams
from radixserve.tokenizer.errors import ApiError, internal_error, retryable
from radixserve.tokenizer.gateway import Gateway
from radixserve.tokenizer.routing.scheduler_request import Delivery, SchedulerRequest
from radixserve.tokenizer.tracing import Attributes, RequestTrace


def new_request_id() -> str:
    return uuid.uuid4().hex  # random: unique across gateways without their agreeing on anything


@dataclass(frozen=True, slots=True)
class Output:
    """What one delivery brought for one choice."""

    index: int  # the choice's place in the response (OpenAI's order: prompt-major)
    text: str  # new text (stop strings cut, partial matches held back)
    token_ids: list[int]  # new tokens
    finish_reason: str | None  # None while the choice runs
    logprobs: pb.Logprobs | None = None  # of token_ids, when the request asked
    prompt_logprobs: pb.Logprobs | None = None  # of the prompt's tokens: once, with the first delivery


def _output(index: int, t: pb.RequestText) -> Output:
    return Output(
        index,
        t.text,
        list(t.token_ids),
        t.finish_reason or None,
        t.logprobs if t.HasField("logprobs") else None,
        t.prompt_logprobs if t.HasField("prompt_logprobs") else None,
    )


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt tokens, those served from a prefix cache


class RequestSession:
    def __init__(
        self,
        gw: Gateway,
        name: str,
        carrier: Mapping[str, str],
        attributes: Attributes,
        start: float | None = None,
        gone: str = "client disconnected",
    ) -> None:
        """``name``, ``carrier`` (the client's trace headers), ``attributes``, ``start``: its trace's;
        ``gone``: what ending before the last result means (the abort reason and trace error)."""
        self.gw = gw
        self.rid = new_request_id()
        self.trace = RequestTrace(name, carrier, {**attributes, "radixserve.request_id": self.rid}, start)
        self._gone = gone
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()  # every choice of every prompt reports here
        self._choices: list[SchedulerRequest] = []  # indexed prompt-major (OpenAI's order for n x prompts)
        self._last: dict[int, pb.RequestText] = {}  # choice index -> its latest delivery
        self._seen_at: dict[int, float] = {}
        self._reasons: list[str] = []
        self._done = False  # the consumer took every result
        self._in_flight = False
        self._ended = False

    @property
    def choice_count(self) -> int:
        return len(self._choices)

    @property
    def done(self) -> bool:
        """Its consumer took every result: whatever comes after, the request was served."""
        return self._done

    async def submit(
        self,
        prompts: Sequence[list[int]],
        sp: SamplingParams,
        n: int = 1,
        skip_special_tokens: bool = True,
        deadline_s: float | None = None,
    ) -> None:
        """``n`` choices of each prompt to the schedulers; raises ApiError (and the session ends).
        ``deadline_s``: the seconds the client still waits, if it said (a gRPC deadline)."""
        try:
            # No scheduler serving: the request waits its turn for one (--hold-timeout), all its prompts.
            async with self.gw.hold.turn(deadline_s) as held:
                self.trace.held(held)
                for p, ids in enumerate(prompts):
                    self._choices += await self.gw.submit(
                        self.rid, ids, sp, n, skip_special_tokens, self.trace, self._queue, p
                    )
        except BaseException as e:  # refused, cancelled (the client went away), or a bug
            # What was submitted of it must not run on: the session ends here.
            err = self._client_error(e)
            self._end(err, "a sibling prompt was rejected" if isinstance(e, ApiError) else None)
            if err is e:
                raise
            raise err from e
        self._in_flight = True
        self.gw.metrics.in_flight.inc()

    def __aiter__(self) -> AsyncIterator[list[Output]]:
        return self._results()

    async def _results(self) -> AsyncIterator[list[Output]]:
        """Outputs as they come, until every choice has finished; raises ApiError if one failed (its
        scheduler went away, it was aborted, ...)."""
        left = len(self._choices)
        while left:
            got = [await self._queue.get()]
            while not self._queue.empty():
                got.append(self._queue.get_nowait())
            texts = []
            for i, item in got:
                if isinstance(item, ApiError):
                    raise item
                texts.append((i, item))
            outputs = self._record(texts)
            left -= sum(o.finish_reason is not None for o in outputs)
            yield outputs
        self._done = True

    def _record(self, texts: list[tuple[int, pb.RequestText]]) -> list[Output]:
        """Latency metrics, finish reasons and the trace's timing for one delivery."""
        m = self.gw.metrics
        now = time.monotonic()
        if self.trace.first_result is None:
            m.ttft.observe(now - self.trace.start)
        self.trace.result()
        outputs = []
        for i, t in texts:
            prev = self._seen_at.get(i)
            if prev is not None and t.token_ids:
                m.itl.observe((now - prev) / len(t.token_ids))
            self._seen_at[i] = now
            self._last[i] = t
            if t.finish_reason:
                m.finished.labels(t.finish_reason).inc()
                self._reasons.append(t.finish_reason)
                if t.finish_reason == "abort":
                    raise retryable(t.error or "the request was aborted")
            outputs.append(_output(i, t))
        return outputs

    def usage(self) -> Usage:
        """The request's token counts from what came so far (final once every choice finished)."""
        prompt = cached = 0
        seen: set[int] = set()
        for c in self._choices:  # a prompt's tokens count once, however many choices it has
            if c.prompt_index not in seen:
                seen.add(c.prompt_index)
                t = self._last.get(c.index)
                prompt += c.prompt_tokens
                cached += t.cached_tokens if t is not None else 0
        completion = sum(t.completion_tokens for t in self._last.values())
        return Usage(prompt, completion, cached)

    async def __aenter__(self) -> RequestSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:  # the block ran to its end, or returned early
            self._end(None)
            return
        err = self._client_error(exc)
        self._end(err)
        if err is not exc:
            raise err from exc

    def _client_error(self, exc: BaseException) -> BaseException:
        """What the front end gets for ``exc``: a bug becomes a 500 that names this request (logged
        under its id); an ApiError, or a cancellation, stays as it is."""
        if isinstance(exc, Exception) and not isinstance(exc, ApiError):
            return internal_error(self.gw.metrics, exc, self.rid)
        return exc

    def _end(self, exc: BaseException | None, abort_reason: str | None = None) -> None:
        """Once: abort what still runs, count the request, end its trace. ``exc``: what ended it (None
        or a cancellation: it finished, or its consumer went away)."""
        if self._ended:
            return
        self._ended = True
        error = exc.message if isinstance(exc, ApiError) else None
        self.gw.release(self._choices, abort_reason or self._gone)
        m = self.gw.metrics
        if self._in_flight:
            m.in_flight.dec()
        usage = self.usage() if self._done else None
        if usage is not None:
            m.e2e.observe(time.monotonic() - self.trace.start)
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.cached_tokens.inc(usage.cached_tokens)
            m.generation_tokens.inc(usage.completion_tokens)
        elif error is None:
            error = self._gone
        self.trace.end(usage, self._reasons, error)
