"""The model runner: Llama / Qwen2 / Qwen3 layer code over the paged KV pool, attention backends, sampler."""
