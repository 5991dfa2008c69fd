"""The one type every operator module passes around: a Kubernetes object (or a piece of one) as
JSON, the way the API serves it and kopf hands it over."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]
