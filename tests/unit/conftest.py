"""Fixtures shared by tests/unit: the gateway's app over scripted schedulers (tests/gateway_harness.py)."""

from tests.gateway_harness import app, engine, gw  # noqa: F401
