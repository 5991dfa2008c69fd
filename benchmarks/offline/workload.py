"""The seeded offline workload: requests (prompt ids, output length, shared prefix or not), their
summary, and the greedy sampling that makes each produce exactly its output length."""

from __future__ import annotations

import _common as common


def build_workload(
    num_requests: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    shared_prefix_frac: float,
    prefix_len: int,
    vocab_size: int,
    seed: int,
) -> list[dict]:
    """Seeded requests: ``input_ids`` (list[int]), ``output_len``, ``shared`` (starts with the prefix).

    A shared request's prompt is the prefix plus random tokens up to its drawn length, at least
    16 of them (so shared prompts are at least ``prefix_len + 16`` long).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    prefix = common.random_token_ids(rng, vocab_size, prefix_len)
    reqs = []
    for _ in range(num_requests):
        n_in = common.draw_len(rng, input_range)
        n_out = common.draw_len(rng, output_range)
        shared = bool(prefix_len > 0 and rng.random() < shared_prefix_frac)
        if shared:
            ids = prefix + common.random_token_ids(rng, vocab_size, max(16, n_in - prefix_len))
        else:
            ids = common.random_token_ids(rng, vocab_size, n_in)
        reqs.append({"input_ids": ids, "output_len": n_out, "shared": shared})
    return reqs


def workload_summary(reqs: list[dict]) -> dict:
    ins = [len(r["input_ids"]) for r in reqs]
    outs = [r["output_len"] for r in reqs]
    return {
        "num_requests": len(reqs),
        "shared_prefix_requests": sum(r["shared"] for r in reqs),
        "prompt_tokens": sum(ins),
        "output_tokens": sum(outs),
        "input_len_mean": sum(ins) / len(ins),
        "input_len_min_max": [min(ins), max(ins)],
        "output_len_mean": sum(outs) / len(outs),
        "output_len_min_max": [min(outs), max(outs)],
    }


def greedy(max_new_tokens: int):
    """Temperature 0, EOS ignored: exactly ``max_new_tokens`` tokens."""
    from radixserve import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def greedy_sampling(reqs: list[dict]) -> list:
    """Each request's sampling: greedy, exactly its ``output_len`` tokens."""
    return [greedy(r["output_len"]) for r in reqs]
