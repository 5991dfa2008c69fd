"""radixserve: serve LLMs on Kubernetes with an SGLang-style engine.

Subpackages, one per component (docs/architecture.md draws how they fit):
    radixserve.common       what every service shares
    radixserve.tokenizer    the front door (OpenAI HTTP + gRPC, routing)
    radixserve.scheduler    the GPU pod: memory, policy, model, event loops
    radixserve.detokenizer  incremental detokenization
    radixserve.operator     the kopf operator
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.common.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams"]

if TYPE_CHECKING:
    from radixserve.scheduler.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":  # lazy: importing radixserve must not pull in torch + transformers
        from radixserve.scheduler.engine import Engine

        return Engine
    raise AttributeError(name)
