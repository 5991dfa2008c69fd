"""The model's text at the gateway: its tokenizer and chat template, token pieces for logprobs, and the
formats read back out of its output (reasoning, tool calls) or imposed on it (tool-call grammars)."""
