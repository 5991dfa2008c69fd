"""The served system's client: requests streamed over HTTP through ``radixserve serve``, Poisson
arrivals or closed-loop clients, one record per request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import _common as common

from .analysis import itl_samples


def chunk_tokens(texts: list[str], n: int) -> tuple[list[int], bool]:
    """Tokens per SSE chunk when ``n`` tokens came in ``len(texts)`` chunks; True if exact.

    A chunk is one token unless the detokenizer held text back (a byte-level BPE token that ends
    inside a UTF-8 character decodes to U+FFFD and waits for the next token): then the held
    tokens come out with the chunk that completes them, whose text has non-ASCII characters
    (U+FFFD or the completed character). The ``n - chunks`` surplus is split over such chunks in
    proportion to their non-ASCII UTF-8 bytes (largest remainder); with no such chunk, evenly.
    """
    c = len(texts)
    surplus = n - c
    if surplus <= 0 or c == 0:
        return [1] * c, surplus == 0
    weights = [sum(len(ch.encode()) for ch in t if ord(ch) > 127) for t in texts]
    if not any(weights):
        weights = [1] * c
    total = sum(weights)
    shares = [surplus * w / total for w in weights]
    extra = [int(x) for x in shares]
    order = sorted(range(c), key=lambda i: shares[i] - extra[i], reverse=True)
    for i in order[: surplus - sum(extra)]:
        extra[i] += 1
    return [1 + e for e in extra], False


def _served_record(req: dict, stream: common.Stream, start: float) -> dict:
    """A served request's record from its stream (times from the moment it was sent)."""
    rec = common.new_record(req, itl=[], chunks=0, finish_reason=stream.finish_reason, error=stream.error)
    rec["arrival"] = stream.sent - start  # the actual send time (the schedule up to event-loop lag)
    n = int(stream.usage["completion_tokens"]) if stream.usage else 0
    rec["output_tokens"] = n
    rec["chunks"] = len(stream.times)
    if not stream.times or rec["error"]:
        rec["error"] = rec["error"] or "no text chunk"
        return rec
    rec["ttft"] = stream.times[0] - stream.sent
    rec["e2e"] = stream.end - stream.sent
    ks, rec["chunk_tokens_exact"] = chunk_tokens(stream.texts, n)
    rec["itl"] = itl_samples(stream.times, ks)
    common.judge_record(rec)
    return rec


async def stream_one(client: Any, url: str, req: dict, start: float) -> dict:
    return _served_record(req, await common.stream_completion(client, url, req, start), start)


async def run_rate_served(url: str, reqs: list[dict]) -> tuple[list[dict], float]:
    async with common.http_client(len(reqs), read_timeout_s=600.0) as client:
        start = time.perf_counter() + 0.05  # every task is created (and sleeping) before t=0
        tasks = [asyncio.create_task(stream_one(client, url, r, start)) for r in reqs]
        records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return list(records), wall


async def run_closed_served(url: str, reqs: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """Closed loop: ``concurrency`` client tasks, client ``j`` streams requests ``j, j + C, ...``
    one after the other (the next is sent as soon as the previous one's stream has ended)."""
    records: list[dict | None] = [None] * len(reqs)
    async with common.http_client(concurrency, read_timeout_s=600.0) as client:
        start = time.perf_counter() + 0.05  # every client is created (and sleeping) before t=0

        async def one_client(j: int) -> None:
            for i in range(j, len(reqs), concurrency):
                rec = await stream_one(client, url, {**reqs[i], "arrival": 0.0}, start)
                rec["client"] = j
                records[i] = rec

        await asyncio.gather(*(one_client(j) for j in range(min(concurrency, len(reqs)))))
        wall = time.perf_counter() - start
    assert all(r is not None for r in records)
    return records, wall  # type: ignore[return-value]


async def warm_served(url: str, vocab_size: int) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=120.0) as client:
        for ids in common.warm_prompts(vocab_size):
            await stream_one(client, url, {"arrival": 0.0, "input_ids": ids, "output_len": 4}, 0.0)
