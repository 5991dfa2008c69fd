"""The front door: OpenAI-compatible HTTP and gRPC, tokenization, cache-aware routing (services issue)."""
