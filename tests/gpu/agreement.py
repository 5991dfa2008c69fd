"""How the CUDA tests compare two runs whose arithmetic differs (other kernels, batching, padding).

Rounding moves logits by about the dtype's precision, and a greedy continuation flips wherever the top
two candidates are that close; from there the continuations legitimately part. So runs are compared
by their logits (or log-probabilities) within a tolerance, and by their tokens only where rounding
cannot have chosen between them. Plain helpers, importable without CUDA (the CPU side of the same
code is checked with them too: docs/gpu.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixserve.common.sampling import SamplingParams
from radixserve.scheduler.batch import ForwardMode
from radixserve.scheduler.req import Req

# FP8 activations move a logit by a few percent of its size: greedy runs agree but near such ties
FP8_LOGPROB_TOL = 0.25


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def assert_equal_but_near_ties(
    got: list[dict[str, Any]], want: list[dict[str, Any]], tol: float, what: str
) -> None:
    """Greedy outputs (asked with ``logprobs >= 2``) of the same prompts: each pair is equal token for
    token, with each token's log-probability within ``tol``, up to where they part; they may part
    only at a near-tie, a position whose top two log-probabilities lie within ``2 * tol`` in one of
    the runs (same context so far, so rounding alone can order them either way)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        gt, wt = g["token_ids"], w["token_ids"]
        n = common_prefix(gt, wt)
        for j in range(n):
            a, b = g["output_logprobs"][j][0], w["output_logprobs"][j][0]
            assert abs(a - b) <= tol, f"{what}: prompt {i} token {j}: logprob {a} vs {b}"
        if n < min(len(gt), len(wt)):
            margins = [out["output_logprobs"][n][2] for out in (g, w)]
            gaps = [tops[0] - tops[1] for tops in margins]
            assert min(gaps) <= 2 * tol, (
                f"{what}: prompt {i} parts at token {n} ({gt[n]} vs {wt[n]}) where the top two "
                f"log-probabilities are {gaps} apart: not a near-tie"
            )


def graph_and_eager_logits(
    engine: Any, prompts: list[list[int]], new_tokens: list[int]
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Greedy decoding of ``prompts`` (``new_tokens`` each) on ``engine``'s parts, stepped by hand;
    for each decode batch that runs padded through the static path (graph replay on CUDA), (batch
    size, its logits from that path, its logits from an eager forward of the same batch unpadded, on
    the same KV). The run continues on the eager forward's tokens, so neither path's rounding
    steers the other."""
    runner, sched = engine.runner, engine.scheduler
    for i, (ids, n) in enumerate(zip(prompts, new_tokens, strict=True)):
        sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        sp.validate()
        sched.add(Req(f"compare{i}", np.asarray(ids, dtype=np.int32), sp))
    steps = []
    with torch.inference_mode():
        while not sched.idle:
            batch = sched.schedule()
            if batch is None:
                break
            fb = runner.prepare(batch)
            if batch.mode is ForwardMode.DECODE and fb.graph_bucket is not None:
                static = runner.graphs.run(fb, runner.futures.resolve(fb.input_ids)).float().clone()
                runner.graphs.enabled = False  # the same batch again, unpadded, on the eager path
                try:
                    fb = runner.prepare(batch)
                finally:
                    runner.graphs.enabled = True
                ids = runner.futures.resolve(fb.input_ids)
                eager = runner.model(ids, fb.positions, fb, runner.backend).logits.float()
                steps.append((batch.size, static, eager))
            sched.process(batch, runner.forward(fb).tokens.tolist())
    return steps


def logits_agree(static: torch.Tensor, eager: torch.Tensor, rel_tol: float) -> str | None:
    """Why two [B, vocab] logits of one batch disagree, or None: each row's relative difference is
    at most ``rel_tol``, and the argmax is the same in every row whose top-two margin exceeds twice
    that row's largest difference (where rounding cannot have swapped them)."""
    rel = (static - eager).norm(dim=-1) / eager.norm(dim=-1)
    if float(rel.max()) > rel_tol:
        return f"relative difference per row {rel.tolist()} over {rel_tol}"
    diff = (static - eager).abs().amax(dim=-1)
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
    if not torch.equal(static.argmax(-1)[clear], eager.argmax(-1)[clear]):
        return "argmax differs in a row whose top two logits are further apart than rounding moves them"
    return None
