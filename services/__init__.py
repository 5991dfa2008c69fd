"""radixserve: serve LLMs on Kubernetes with an SGLang-style engine.

Subpackages, one per component (see ARCHITECTURE.md):
    radixserve.common       what every service shares
    radixserve.tokenizer    the front door (OpenAI HTTP + gRPC, routing)
    radixserve.scheduler    the GPU pod: memory, policy, model, event loops
    radixserve.detokenizer  incremental detokenization
    radixserve.operator     the kopf operator
"""

__version__ = "0.1.0"
