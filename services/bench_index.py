"""The benchmarks ``radixserve bench NAME`` runs: their names, one line on each, and how one is
found in the source checkout's benchmarks/ folder (benchmarks are not part of the installed package)."""

from __future__ import annotations

import types

# Each benchmark parses its own flags (``radixserve bench NAME --help`` is the benchmark's help): the
# CLI forwards every argument after the name, so no flag or default is restated here.
BENCHMARKS = {
    "offline": "offline throughput: HF generate (static batches) vs the Engine, normal and overlap",
    "serving": "online serving: the HTTP server vs the Engine in-process, Poisson arrivals and closed loops",
    "gpu": "GPU decode: step time vs the memory floor, kernels per step, offline throughput vs HF",
    "routing": "cache-aware vs least-load vs round-robin routing over 4 scheduler processes",
    "spread": "1 vs 2 scheduler pods on prompts that share nothing",
    "failover": "continuation TTFT after a scheduler SIGKILL, with and without the prefix on the other pod",
    "policy_sim": "hit rate and queue wait of each schedule policy (cost model, virtual time)",
    "scheduler_overhead": "CPU time of one scheduling step at 64 / 256 / 1024 requests",
    "decode_attention": "the CPU decode-attention kernel against the torch reference",
    "tracing_overhead": "served throughput with every request traced and exported vs tracing off",
    "tensor_parallel": "offline throughput with the model split over 1 vs 2 processes (tensor parallelism)",
    "logits_features": "what logprobs, penalties and JSON constraints cost, and free requests beside them",
    "moe": "MoE offline throughput on CPU (a small Qwen3-MoE) vs HF generate, and the MoE layer's launches",
    "hybrid": "prefix caching on a hybrid (Qwen3.5): state snapshots on vs off, hit rate vs a dense model",
    "cold_start": "a scheduler's start phase by phase, the loader's read rate vs cat, a held request's TTFT",
    "kv_load_back": "one step's load-back from the host KV tier (8B-llama-shaped KV), as the metric times it",
    "kv_tiers": "multi-turn conversations with the KV tiers off, a host tier, host + disk (prefill, TTFT)",
}


def load_benchmark(name: str) -> types.ModuleType:
    """``benchmarks/<name>`` of this source checkout (a package, or a single ``<name>.py``) as a
    module, imported once per process (benchmarks are not part of the installed package);
    FileNotFoundError outside a checkout."""
    import importlib.util
    import sys
    from pathlib import Path

    key = f"radixserve_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    package = root / name / "__init__.py"
    if package.is_file():
        spec = importlib.util.spec_from_file_location(
            key, package, submodule_search_locations=[str(package.parent)]
        )
    elif (root / f"{name}.py").is_file():
        spec = importlib.util.spec_from_file_location(key, root / f"{name}.py")
    else:
        raise FileNotFoundError(f"{root / name} not found (run from a source checkout)")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[key]
        raise
    return mod
