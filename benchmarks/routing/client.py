"""The benchmark's HTTP client: streamed completions through the gateway, one record per request."""

from __future__ import annotations

import asyncio
from typing import Any

import _common as common
from _common import SPECIAL_IDS


def _routed_record(req: dict, stream: common.Stream, start: float) -> dict:
    """A request's record from its stream (times from the moment it was sent), with the prompt
    tokens its pod found cached."""
    rec = common.new_record(
        req,
        tenant=req.get("tenant"),
        cached_tokens=0,
        finish_reason=stream.finish_reason,
        error=stream.error,
    )
    rec["arrival"] = stream.sent - start  # the actual send time (the schedule up to event-loop lag)
    usage = stream.usage
    if usage:
        rec["output_tokens"] = int(usage["completion_tokens"])
        rec["prompt_tokens"] = int(usage["prompt_tokens"])
        rec["cached_tokens"] = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if not stream.times or rec["error"]:
        rec["error"] = rec["error"] or "no text chunk"
        return rec
    rec["ttft"] = stream.times[0] - stream.sent
    rec["e2e"] = stream.end - stream.sent
    common.judge_record(rec)
    return rec


async def stream_one(client: Any, url: str, req: dict, start: float) -> dict:
    return _routed_record(req, await common.stream_completion(client, url, req, start), start)


async def run_requests(url: str, reqs: list[dict], start: float) -> list[dict]:
    async with common.http_client(len(reqs), read_timeout_s=900.0) as client:
        tasks = [asyncio.create_task(stream_one(client, url, r, start)) for r in reqs]
        return list(await asyncio.gather(*tasks))


async def warm(url: str, n: int, vocab_size: int) -> None:
    """``n`` short requests one after another, prompts unrelated to the tenants: every pod runs a
    forward before the clock starts (round-robin and the least-loaded rotation both visit each)."""
    import httpx

    async with httpx.AsyncClient(timeout=120.0) as client:
        for i in range(n):
            ids = [SPECIAL_IDS + (97 * i + 13 * j + 1) % (vocab_size - SPECIAL_IDS) for j in range(24)]
            rec = await stream_one(client, url, {"arrival": 0.0, "input_ids": ids, "output_len": 2}, 0.0)
            if not rec["ok"]:
                raise RuntimeError(f"warm-up request failed: {rec['error']}")
