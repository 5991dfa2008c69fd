"""What the gateway sends to continue a stream elsewhere (routing/failover.py): the same request
under a new rid, with the output its client has, prompt logprobs not asked again."""

from __future__ import annotations

import asyncio

from radixserve.common.rpc import pb
from radixserve.tokenizer.routing.failover import Failover, continuation_request, failover_rid
from radixserve.tokenizer.routing.scheduler_pool import SchedulerHandle
from radixserve.tokenizer.routing.scheduler_request import SchedulerRequest
from radixserve.tokenizer.tracing import RequestTrace


def test_each_continuation_gets_a_rid_of_its_own() -> None:
    assert failover_rid("abc-0", 1) == "abc-0.f1"
    assert failover_rid("abc-0.f1", 2) == "abc-0.f2"
    assert failover_rid("abc-0.retry", 1) == "abc-0.retry.f1"


def test_a_continuation_is_the_request_with_what_its_client_has() -> None:
    request = pb.TokenizedRequest(rid="abc-0", input_ids=[1, 2, 3], reply_to="gw:1")
    request.sampling.max_new_tokens, request.sampling.seed, request.sampling.prompt_logprobs = 50, 7, 2
    c = SchedulerRequest(
        "abc-0", 0, SchedulerHandle("pod:1"), asyncio.Queue(), 3, 0, request, RequestTrace("t", {}, {})
    )
    c.output_ids, c.text_chars = [9, 8, 7], 11
    r = continuation_request(c, "abc-0.f1")
    assert r.rid == "abc-0.f1" and list(r.input_ids) == [1, 2, 3] and r.reply_to == "gw:1"
    assert r.sampling.max_new_tokens == 50 and r.sampling.seed == 7  # the request's own budget and seed
    assert not r.sampling.HasField("prompt_logprobs")  # they came with the first message
    assert list(r.continuation.output_ids) == [9, 8, 7] and r.continuation.text_chars == 11
    assert request.rid == "abc-0" and not request.HasField("continuation")  # the original is kept
    c.output_ids.append(6)  # a second failover carries all of it
    assert list(continuation_request(c, "abc-0.f2").continuation.output_ids) == [9, 8, 7, 6]


def test_a_stream_that_had_all_its_tokens_ends_with_length_instead_of_moving() -> None:
    """Its pod died after the last token but before the final message: nothing is left to run."""
    request = pb.TokenizedRequest(rid="abc-0", input_ids=[1, 2, 3], reply_to="gw:1")
    request.sampling.max_new_tokens = 3
    queue: asyncio.Queue = asyncio.Queue()
    c = SchedulerRequest(
        "abc-0", 0, SchedulerHandle("pod:1"), queue, 3, 0, request, RequestTrace("t", {}, {})
    )
    c.output_ids, c.cached_tokens = [9, 8, 7], 2
    Failover(None, max_failovers=2).move(c, c.scheduler, "scheduler", "it died")  # type: ignore[arg-type]
    index, end = queue.get_nowait()
    assert index == 0 and end.finish_reason == "length" and not end.token_ids and not end.text
    assert (end.prompt_tokens, end.completion_tokens, end.cached_tokens) == (3, 3, 2)
