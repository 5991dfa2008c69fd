"""ASGI middleware that bounds a request body before anything parses it."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.tokenizer.errors import ApiError


class BodyLimits:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 before anything parses it, and
    JSON nested deeper than ``max_depth`` a 400 (Python's parser would recurse out of its stack)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int) -> None:
        self.app, self.max_bytes, self.max_depth = app, max_bytes, max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, 413, f"the request body is over {self.max_bytes} bytes", "body")
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, 413, f"the request body is over {self.max_bytes} bytes", "body")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        # Nesting can be no deeper than the count of openers: almost every body skips the byte scan.
        openers = body.count(b"[") + body.count(b"{")
        if openers > self.max_depth and _json_depth(body) > self.max_depth:
            await self._refuse(
                send, 400, f"the JSON body is nested deeper than {self.max_depth} levels", "body"
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send: Send, status: int, message: str, param: str) -> None:
        body = json.dumps(ApiError(status, message, param=param).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _json_depth(body: bytes) -> int:
    """How deep ``[`` / ``{`` nest in ``body``, outside strings (no parsing: linear in the bytes)."""
    depth = deepest = 0
    in_string = escaped = False
    for b in body:
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:  # quote
                in_string = False
        elif b == 0x22:
            in_string = True
        elif b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest
