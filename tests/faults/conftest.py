"""Processes that die under load, as real processes on loopback (``launcher.Cluster``, supervised the
way ``radixserve serve`` supervises them)."""

from __future__ import annotations

from tests.helpers.cluster import engine, model_dir  # noqa: F401  (fixtures)
