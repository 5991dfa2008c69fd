"""Fixtures every test folder may use, and the test tiers.

Whole folders of tests that start servers, clusters or clients (``integration``, ``faults``,
``clients``, ``benchmarks``) and the operator's runs against the API emulator (``*_e2e.py``) are
marked ``slow`` here; a slow test elsewhere carries the mark itself. ``pytest -m "not slow"`` is the
inner loop (docs/development.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from radixserve.common import zygote
from radixserve.common.demo_model import make_demo_model

TESTS = Path(__file__).resolve().parent
SLOW_FOLDERS = frozenset({"integration", "faults", "clients", "benchmarks"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(TESTS):
            continue
        folder = path.relative_to(TESTS).parts[0]
        if folder in SLOW_FOLDERS or path.name.endswith("_e2e.py"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def zygote_for_the_slow_tests(request: pytest.FixtureRequest) -> None:
    """A session with slow tests starts its zygote at once (radixserve.common.zygote: it imports
    torch and transformers while the first tests run): every cluster it starts, and the
    tensor-parallel ranks of the engines it builds, are forked from it, not imported afresh."""
    if any(item.get_closest_marker("slow") for item in request.session.items):
        zygote.shared()


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``demo_model(arch="llama", size="tiny", thinking=False)``: that generated demo model's folder,
    built once per test session. Tests read it; one that changes a model copies it first."""
    built: dict[tuple[str, str, bool], Path] = {}

    def get(arch: str = "llama", size: str = "tiny", thinking: bool = False) -> Path:
        key = (arch, size, thinking)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"demo-{arch}-{size}{'-thinking' if thinking else ''}")
            built[key] = make_demo_model(folder / "model", arch=arch, size=size, thinking=thinking)
        return built[key]

    return get


@pytest.fixture
def clock():
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    return Clock()
