"""Fixtures shared by tests/unit: the gateway's app over scripted schedulers (tests/helpers/gateway.py)."""

from tests.helpers.gateway import app, engine, gw  # noqa: F401
