"""One served cluster for the third-party client tests: `radixserve serve`'s processes on a thinking
demo model (Qwen3's <think> tokens and enable_thinking template) with --reasoning-parser qwen3, so the
same server answers plain, tool-calling, structured and reasoning requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from radixserve.launcher import Cluster
from tests.helpers.cluster import start_cluster


@pytest.fixture(scope="session")
def thinking_model(demo_model):
    return demo_model("qwen3", thinking=True)


@pytest.fixture(scope="session")
def served(thinking_model) -> Iterator[Cluster]:
    c = start_cluster(thinking_model, schedulers=1, gateway_args=["--reasoning-parser", "qwen3"])
    yield c
    c.stop(drain_timeout=5)
