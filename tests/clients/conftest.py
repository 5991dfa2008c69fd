"""One served cluster for the third-party client tests: `radixserve serve`'s processes on a thinking
demo model (Qwen3's <think> tokens and enable_thinking template) with --reasoning-parser qwen3, so the
same server answers plain, tool-calling, structured and reasoning requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from radixserve.common.demo_model import make_demo_model
from radixserve.launcher import Cluster
from tests.integration.conftest import start_cluster


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory: pytest.TempPathFactory):
    return make_demo_model(tmp_path_factory.mktemp("clients") / "m", arch="qwen3", size="tiny", thinking=True)


@pytest.fixture(scope="session")
def served(thinking_model) -> Iterator[Cluster]:
    c = start_cluster(thinking_model, schedulers=1, gateway_args=["--reasoning-parser", "qwen3"])
    yield c
    c.stop(drain_timeout=5)
