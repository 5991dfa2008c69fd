"""``--profile``: where a normal-mode engine run spends its time.

Module timers (instance-level wrappers on the loaded model, no engine code touched) over a whole
run, split by step kind (prefill/extend vs decode); then a torch.profiler op table over a few decode
steps of a fresh run at full batch. Timers add a little overhead.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as common

from .workload import greedy, greedy_sampling

# What the runner's forward wrapper counts per step kind (not a timed part of the forward).
COUNTS = ("steps", "tokens", "requests", "forward_total")


def profile_engine(
    model_path: Path, reqs: list[dict], eargs: dict, vocab_size: int, op_steps: int = 4
) -> dict:
    """Module timers over a whole normal-mode run, then the op table of ``op_steps`` decode steps."""
    breakdown = module_time_breakdown(model_path, reqs, eargs, vocab_size)
    breakdown["decode_ops"] = decode_op_table(model_path, reqs, eargs, op_steps)
    return breakdown


# -------------------------------------------------------------------------- module timers
class ModuleTimers:
    """Seconds spent in the model's modules, by the kind of step (``fb.mode``) that called them."""

    def __init__(self) -> None:
        self.by_mode: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.mode = "?"

    def wrap(self, obj: Any, attr: str, key: str) -> None:
        orig: Callable = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.by_mode[self.mode][key] += time.perf_counter() - t

        object.__setattr__(obj, attr, timed)

    def instrument(self, runner: Any) -> None:
        """The runner's forward (sets the step kind, counts steps / tokens / requests) and the
        modules inside it."""
        orig_forward = runner.forward

        def forward(fb: Any) -> Any:
            self.mode = fb.mode.name.lower()
            t = self.by_mode[self.mode]
            t["steps"] += 1
            t["tokens"] += float(fb.extend_lens.sum())
            t["requests"] += fb.batch_size
            start = time.perf_counter()
            try:
                return orig_forward(fb)
            finally:
                t["forward_total"] += time.perf_counter() - start

        runner.forward = forward
        self.wrap(runner.backend, "forward", "attention (kv write + gather + sdpa)")
        for layer in runner.model.model.layers:
            for p in ("qkv_proj", "o_proj"):
                self.wrap(getattr(layer.self_attn, p), "forward", "qkv/o projections")
            self.wrap(layer.mlp, "forward", "mlp")
            self.wrap(layer.input_layernorm, "forward", "rmsnorm")
            self.wrap(layer.post_attention_layernorm, "forward", "rmsnorm")
        self.wrap(runner.model.ops, "rope_inputs", "rope cos/sin")
        self.wrap(runner.sampler, "__call__", "sampler")

    def summary(self) -> dict[str, dict]:
        """Per step kind: counts, forward time, and each part's seconds and share of the forward
        (what no timer covers is the ``other`` part)."""
        out = {}
        for m, t in self.by_mode.items():
            fwd = t.get("forward_total", 0.0)
            parts = {k: v for k, v in t.items() if k not in COUNTS}
            parts["other (embed, rope apply, residual adds, lm_head, futures)"] = fwd - sum(parts.values())
            out[m] = {
                "steps": int(t["steps"]),
                "tokens": int(t["tokens"]),
                "mean_batch_requests": t["requests"] / max(1, t["steps"]),
                "forward_s": fwd,
                "forward_ms_per_step": 1e3 * fwd / max(1, t["steps"]),
                "parts_s": {k: round(v, 4) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
                "parts_frac_of_forward": {k: round(v / fwd, 4) for k, v in parts.items() if fwd > 0},
            }
        return out


def module_time_breakdown(model_path: Path, reqs: list[dict], eargs: dict, vocab_size: int) -> dict:
    """One timed normal-mode run of the workload with the module timers on."""
    from radixserve import Engine

    timers = ModuleTimers()
    engine = Engine(str(model_path), disable_overlap=True, **eargs)
    try:
        common.warm_engine(engine, vocab_size)
        timers.instrument(engine.runner)
        st = engine.loop.stats
        s0, h0 = st.steps, st.host_s
        t0 = time.perf_counter()
        engine.generate(input_ids=[r["input_ids"] for r in reqs], sampling_params=greedy_sampling(reqs))
        wall = time.perf_counter() - t0
        host = st.host_s - h0
        steps = st.steps - s0
    finally:
        engine.shutdown()
    breakdown: dict[str, Any] = {"wall_s": wall, "steps": steps, "host_s": host, **timers.summary()}
    del engine
    gc.collect()
    return breakdown


# ------------------------------------------------------------------------------ op table
def _step(engine: Any) -> Any:
    """One scheduler step by hand: schedule, prepare, forward, process; returns the batch."""
    sched, runner = engine.scheduler, engine.runner
    batch = sched.schedule()
    assert batch is not None
    sched.process(batch, runner.forward(runner.prepare(batch)).tokens.tolist())
    return batch


def decode_op_table(model_path: Path, reqs: list[dict], eargs: dict, op_steps: int) -> dict:
    """Op-level table for decode steps at full batch (all requests running)."""
    from torch.profiler import ProfilerActivity, profile

    from radixserve import Engine
    from radixserve.scheduler.req import Req

    engine = Engine(str(model_path), disable_overlap=True, **eargs)
    try:
        for i, r in enumerate(reqs):
            sp = greedy(r["output_len"] + op_steps + 8)
            engine.scheduler.add(Req(f"p{i}", list(r["input_ids"]), sp))
        batch = None
        while batch is None or batch.mode.name != "DECODE":
            batch = _step(engine)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(op_steps):
                batch = _step(engine)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops) or 1
        table = {
            "steps": op_steps,
            "batch_requests": batch.size,
            "max_context": int((batch.prefix_lens + batch.extend_lens).max()),
            "top_ops_self_ms_per_step": {
                e.key: round(e.self_cpu_time_total / 1e3 / op_steps, 2) for e in ops[:12]
            },
            "top_ops_frac": {e.key: round(e.self_cpu_time_total / total, 4) for e in ops[:12]},
        }
    finally:
        engine.shutdown()
    del engine
    gc.collect()
    return table
