"""The cost model: the virtual time one engine step takes (no GPU and no model run here)."""

from __future__ import annotations

from radixserve.scheduler.batch import ForwardMode

STEP_OVERHEAD_S = 5e-3  # fixed per engine step
PREFILL_PER_TOKEN_S = 1e-4  # per computed (extend) token: 0.1 ms
DECODE_PER_REQ_S = 5e-5  # per request in a decode batch: 0.05 ms
ATTN_PER_KV_TOKEN_S = 2e-7  # per KV token read by attention, both modes: 0.2 us
COST_MODEL = {
    "kind": "cost model (virtual time), NOT a GPU forward pass",
    "formula": "step_s = overhead + prefill_per_token*sum(extend_lens) + decode_per_req*batch_size[decode]"
    " + attn_per_kv_token*sum(prefix_lens + extend_lens)",
    "step_overhead_s": STEP_OVERHEAD_S,
    "prefill_per_token_s": PREFILL_PER_TOKEN_S,
    "decode_per_req_s": DECODE_PER_REQ_S,
    "attn_per_kv_token_s": ATTN_PER_KV_TOKEN_S,
}
BANNER = (
    "forward pass = COST MODEL in virtual time (no GPU, no model); the scheduler, cache and policies are real"
)


def step_time(batch) -> float:
    """One engine step's virtual seconds (the formula in ``COST_MODEL``)."""
    t = STEP_OVERHEAD_S + ATTN_PER_KV_TOKEN_S * float((batch.prefix_lens + batch.extend_lens).sum())
    if batch.mode is ForwardMode.EXTEND:
        t += PREFILL_PER_TOKEN_S * float(batch.extend_lens.sum())
    else:
        t += DECODE_PER_REQ_S * batch.size
    return t
