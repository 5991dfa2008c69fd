"""The reference the engine tests hold outputs to: Hugging Face transformers' own greedy generation on
the same folder, over a few prompts that share a system prefix (so the radix cache has something to
hit)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SYSTEM = "You are a helpful assistant. Answer briefly and do not repeat the question.\n"
PROMPTS = [
    SYSTEM + "def add(a, b):",
    SYSTEM + "import os\nimport sys",
    "The quick brown fox",
    SYSTEM + "class Stack:\n    def push(self, x):",
    "x = 1",
    SYSTEM + "for i in range(10):",
]
NEW = 12


def hf_greedy(path, prompts, new=NEW):
    """HF generate, greedy, exactly ``new`` tokens: no EOS stop, and no EOS suppression either
    (``min_new_tokens`` would mask EOS logits, which our ``ignore_eos`` does not)."""
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    hf.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        ids = tok.encode(p)
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)
        assert gen.shape[1] == len(ids) + new
        out.append(gen[0, len(ids) :].tolist())
    return out


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the block: HF's small ops (the hybrids' depthwise conv1d)
    are 100x slower on two threads of a shared two-core machine than on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
