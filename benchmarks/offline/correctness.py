"""Correctness: a few requests re-run through HF unpadded (batch 1), their greedy token ids compared
with the Engine's."""

from __future__ import annotations

from typing import Any

from .runners import hf_generate


def pick_check_requests(reqs: list[dict], k: int) -> list[int]:
    """The shortest shared-prefix request (a radix-cache hit) and the shortest others, ``k`` in all."""
    if k <= 0:
        return []
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i]["input_ids"]) + reqs[i]["output_len"])
    first = next((i for i in order if reqs[i]["shared"] and i > 0), None)
    picked = [] if first is None else [first]
    picked += [i for i in order if i not in picked][: k - len(picked)]
    return sorted(picked)


def check_against_hf(model, reqs: list[dict], idx: list[int], ours: dict[str, list]) -> list[dict]:
    rows = []
    for i in idx:
        ref = hf_generate(model, [reqs[i]["input_ids"]], reqs[i]["output_len"])[0]
        row: dict[str, Any] = {"request": i, "prompt_len": len(reqs[i]["input_ids"]), "output_len": len(ref)}
        row["shared_prefix"] = reqs[i]["shared"]
        for name, outs in ours.items():
            got = outs[i]
            first = next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)
            if first is None and len(got) != len(ref):
                first = min(len(got), len(ref))
            row[f"{name}_equal"] = first is None
            row[f"{name}_first_mismatch"] = first
        rows.append(row)
    return rows
