"""Stored responses (``store: true``): what ``previous_response_id`` continues and
``GET /v1/responses/{id}`` returns, per API key (``owner``: a digest of the key; one owner when the
gateway takes none), bounded.

Two stores, one contract: ``MemoryResponseStore`` in the gateway (one gateway; the most recent
``max_entries`` responses within ``max_bytes``, each for ``ttl_s``), ``RedisResponseStore`` in the
prefix index's Redis (gateways behind one Service share it; every response for ``ttl_s``, under the
index's key prefix, which its Redis user is limited to). A record is the response object and the
conversation so far as chat messages (what a follow-up request's history is)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from radixserve.common.service_config import GatewayConfig

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: Json  # the Response object
    messages: list[Json]  # the conversation up to and with this response, as chat messages

    def dumps(self) -> str:
        return json.dumps({"response": self.response, "messages": self.messages}, ensure_ascii=False)

    @staticmethod
    def loads(text: str) -> StoredResponse:
        obj = json.loads(text)
        return StoredResponse(obj["response"], obj["messages"])


def owner_of(api_key: str | None) -> str:
    """Whose responses these are: a digest of the API key presented (never the key itself)."""
    if api_key is None:
        return "-"
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class ResponseStore(Protocol):
    async def put(self, owner: str, response_id: str, record: StoredResponse) -> None: ...

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...


class MemoryResponseStore:
    def __init__(
        self, max_entries: int, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._clock = clock
        self._items: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()  # -> (expiry, json)
        self.bytes = 0

    async def put(self, owner: str, response_id: str, record: StoredResponse) -> None:
        text = record.dumps()
        if len(text) > self.max_bytes:
            return  # larger than the whole store: not kept (a follow-up gets a 404 naming it)
        self._drop((owner, response_id))
        self._items[(owner, response_id)] = (self._clock() + self.ttl_s, text)
        self.bytes += len(text)
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        found = self._items.get((owner, response_id))
        if found is None:
            return None
        if found[0] < self._clock():
            self._drop((owner, response_id))
            return None
        self._items.move_to_end((owner, response_id))
        return StoredResponse.loads(found[1])

    async def delete(self, owner: str, response_id: str) -> bool:
        return self._drop((owner, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        found = self._items.pop(key, None)
        if found is not None:
            self.bytes -= len(found[1])
        return found is not None


class RedisResponseStore:
    """Over a synchronous redis-py client (the prefix index's), called off the event loop."""

    def __init__(self, client: Any, key_prefix: str, ttl_s: float) -> None:
        self.redis, self.ns, self.ttl_ms = client, key_prefix, max(1, int(ttl_s * 1000))

    def _key(self, owner: str, response_id: str) -> str:
        return f"{self.ns}resp:{owner}:{response_id}"

    async def put(self, owner: str, response_id: str, record: StoredResponse) -> None:
        await asyncio.to_thread(self.redis.set, self._key(owner, response_id), record.dumps(), px=self.ttl_ms)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        text = await asyncio.to_thread(self.redis.get, self._key(owner, response_id))
        return StoredResponse.loads(text) if text is not None else None

    async def delete(self, owner: str, response_id: str) -> bool:
        return bool(await asyncio.to_thread(self.redis.delete, self._key(owner, response_id)))


def open_store(index: object, config: GatewayConfig) -> ResponseStore:
    """Where a gateway keeps its responses: where its prefix index is (``index``), so the gateways
    that share a Redis index share them too."""
    from radixserve.common.prefix_index import RedisPrefixIndex

    if isinstance(index, RedisPrefixIndex):
        return RedisResponseStore(index.redis, index.key_prefix, config.response_ttl)
    mb = config.response_store_mb
    return MemoryResponseStore(config.response_store_entries, mb << 20, config.response_ttl)
