"""Small pieces every HTTP route of the gateway shares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer a stream


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (a non-streamed request's wait is cut short by it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Coroutine[object, object, T]) -> T | None:
    """``work``'s result, or None when the client went away first (``work`` is cancelled then: the
    session it reads ends, which frees the scheduler's slots at once)."""
    done_task = asyncio.create_task(work)
    gone = asyncio.create_task(disconnected(request))
    done, _ = await asyncio.wait({done_task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if done_task not in done:
        done_task.cancel()
        return None
    gone.cancel()
    return done_task.result()


async def submitted(request: Request, submitting: Coroutine[object, object, None], watch: bool) -> bool:
    """Runs ``submitting``; False when the client went away first (it is cancelled then). ``watch``:
    whether to look for that at all (a request held for want of a scheduler may wait long enough for
    its client to leave; without the hold a submission is over in milliseconds)."""
    if not watch:
        await submitting
        return True

    async def done() -> bool:
        await submitting
        return True

    return await unless_gone(request, done()) is not None


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
