"""The Responses API's store in a real Redis: what gateways behind one Service share."""

from __future__ import annotations

import asyncio

import pytest

from radixserve.common.prefix_index import RedisPrefixIndex, acl_rules
from radixserve.common.service_config import GatewayConfig
from radixserve.tokenizer.openai_api.response_store import RedisResponseStore, StoredResponse, open_store
from tests.redis_server import redis_server_fixture  # noqa: F401  (the redis_server fixture)


@pytest.mark.asyncio
async def test_the_redis_store_keeps_responses_under_the_index_prefix_with_a_ttl(redis_server):
    """A real redis-server, logged in as the user the operator makes for a service (its key prefix
    and the index's commands only): what gateways behind one Service share."""
    prefix = "rs:ns/svc:"
    redis_server.add_user("gw", "pw", acl_rules(prefix))
    index = RedisPrefixIndex(redis_server.url_for("gw", "pw"), prefix)
    store = open_store(index, GatewayConfig(schedulers=("a:1",), response_ttl=0.5))
    assert isinstance(store, RedisResponseStore)
    record = StoredResponse({"id": "resp_1", "output": []}, [{"role": "user", "content": "hi"}])
    await store.put("owner", "resp_1", record)
    assert await store.get("owner", "resp_1") == record
    assert await store.get("someone-else", "resp_1") is None
    admin = redis_server.client()
    (key,) = admin.keys("*")
    assert str(key).startswith(prefix) and 0 < admin.pttl(key) <= 500
    assert await store.delete("owner", "resp_1") and not await store.delete("owner", "resp_1")
    await store.put("owner", "resp_2", record)
    await asyncio.sleep(0.7)
    assert await store.get("owner", "resp_2") is None  # expired
