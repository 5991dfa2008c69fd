"""Fixtures of the chart tests: helm with its own config, cache and data folders; no helm, no test."""

from __future__ import annotations

import os

import pytest

from tests.helm.chart import HELM


@pytest.fixture(autouse=True, scope="module")
def _needs_helm() -> None:
    if HELM is None:
        pytest.fail("helm not found: run scripts/test-deps (or set RADIXSERVE_HELM)", pytrace=False)


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("helm")
    return {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CONFIG", "CACHE", "DATA")}}
