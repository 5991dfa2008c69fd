"""Real processes on loopback: the gateway, scheduler(s) and detokenizer that `radixserve serve` runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from radixserve.launcher import Cluster
from tests.helpers.cluster import engine, model_dir, start_cluster  # noqa: F401  (fixtures)


@pytest.fixture(scope="session")
def cluster(model_dir) -> Iterator[Cluster]:  # noqa: F811  (the fixture imported above)
    """Two schedulers behind one gateway (round-robin, so tests know where requests go)."""
    c = start_cluster(model_dir, schedulers=2)
    yield c
    c.stop(drain_timeout=5)
