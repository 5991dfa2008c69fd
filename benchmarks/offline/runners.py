"""The systems under test, each run once over a workload and measured: HF ``generate`` in static
batches (the baseline), and the Engine on its normal or overlap loop."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from pathlib import Path

import _common as common

from .workload import greedy_sampling


# ------------------------------------------------------------------------------- timing
def _timing(m: common.Meter) -> dict:
    """Wall time, process CPU time, load average and page faults around one system's timed run."""
    return {
        "wall_s": m.wall_s,
        "process_cpu_s": m.cpu_s,
        "cpu_per_wall": m.cpu_s / m.wall_s if m.wall_s > 0 else 0.0,
        "loadavg_1m_before_after": m.loadavg_before_after(),
        "minor_page_faults": m.faults,  # fresh large tensors fault their pages in
    }


def _rates(rec: dict, prompt_tokens: int, output_tokens: int) -> None:
    w = rec["wall_s"]
    rec["prompt_tokens"] = prompt_tokens
    rec["output_tokens"] = output_tokens
    rec["output_tok_s"] = output_tokens / w
    rec["total_tok_s"] = (prompt_tokens + output_tokens) / w


# -------------------------------------------------------------------------------- HF
def load_hf(model_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    gen = model.generation_config
    gen.eos_token_id = None  # never stop early: every row runs to the batch's max_new_tokens
    gen.do_sample = False
    gen.temperature, gen.top_p, gen.top_k = None, None, None
    gen.use_cache = True
    if gen.pad_token_id is None:
        gen.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return model


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """One static batch: left padding + attention mask; returns each row's generated ids."""
    import torch

    pad = int(model.generation_config.pad_token_id)
    width = max(len(p) for p in prompts)
    dev = model.device  # the CPU here; benchmarks/gpu runs the same baseline on a GPU
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=dev)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=dev
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens)
    return out[:, width:].tolist()


def run_hf(model, reqs: list[dict], batch_size: int) -> dict:
    useful = raw = 0
    outputs: list[list[int]] = []
    with common.Meter() as m:
        for s in range(0, len(reqs), batch_size):
            chunk = reqs[s : s + batch_size]
            gen = hf_generate(model, [r["input_ids"] for r in chunk], max(r["output_len"] for r in chunk))
            for r, g in zip(chunk, gen, strict=True):
                outputs.append(g[: r["output_len"]])
                raw += len(g)
                useful += min(len(g), r["output_len"])
    rec = {"system": "hf", "batch_size": batch_size, **_timing(m)}
    _rates(rec, sum(len(r["input_ids"]) for r in reqs), useful)
    rec["raw_generated_tokens"] = raw
    rec["raw_generated_tok_s"] = raw / rec["wall_s"]
    rec["num_batches"] = -(-len(reqs) // batch_size)
    rec["outputs_exact"] = all(len(o) == r["output_len"] for o, r in zip(outputs, reqs, strict=True))
    return rec


def hf_sweep(
    model, reqs: list[dict], batch_sizes: Sequence[int], before_each: Callable[[], object] = lambda: None
) -> list[dict]:
    """The HF baseline at each static batch size, after an untimed warm-up; ``before_each`` runs
    before each timed run (on a GPU: a device sync, so the run times only its own work)."""
    hf_generate(model, [reqs[0]["input_ids"][:16]], 4)  # warm-up (untimed)
    sweep = []
    for b in batch_sizes:
        before_each()
        rec = run_hf(model, reqs, b)
        sweep.append(rec)
        print(f"hf B={b}: {rec['wall_s']:.1f}s, {rec['output_tok_s']:.1f} useful out tok/s", flush=True)
    return sweep


# ------------------------------------------------------------------------------- ours
def engine_args(reqs: list[dict], max_running_requests: int, page_size: int = 16) -> dict:
    need = sum(len(r["input_ids"]) + r["output_len"] + page_size for r in reqs)
    return dict(
        page_size=page_size,
        max_total_tokens=need + 64 * page_size,  # everything fits: no retraction, no eviction
        max_running_requests=max_running_requests,
    )


def run_ours(
    model_path: Path,
    reqs: list[dict],
    overlap: bool,
    eargs: dict,
    vocab_size: int,
    thread_min_ms: float | None = None,
) -> tuple[dict, list]:
    """``thread_min_ms``: the overlap loop's ``cpu_overlap_thread_min_ms`` (None: the engine's default)."""
    from radixserve import Engine
    from radixserve.scheduler.event_loop import LoopStats

    if thread_min_ms is not None:
        eargs = {**eargs, "cpu_overlap_thread_min_ms": thread_min_ms}
    engine = Engine(str(model_path), disable_overlap=not overlap, **eargs)
    stream = engine.loop.stream
    try:
        common.warm_engine(engine, vocab_size)
        st = engine.loop.stats = LoopStats()  # count the measured run only, not the warm-up
        sp = greedy_sampling(reqs)
        with common.Meter() as m:
            outs = engine.generate(input_ids=[r["input_ids"] for r in reqs], sampling_params=sp)
        steps, host, wait = st.steps, st.host_s, st.wait_s
        per_step = list(st.per_step_host_s)
        # CPU overlap: forwards run on the worker thread / inline (the warm-up's included)
        threaded, inline = (stream.threaded, stream.inline) if stream is not None else (0, 0)
    finally:
        engine.shutdown()
    rec = {"system": "ours_overlap" if overlap else "ours_normal", **_timing(m)}
    got = [len(o["token_ids"]) for o in outs]
    _rates(rec, sum(len(r["input_ids"]) for r in reqs), sum(got))
    rec.update(
        completion_tokens=got,
        outputs_exact=all(g == r["output_len"] for g, r in zip(got, reqs, strict=True)),
        cached_prompt_tokens=sum(o["meta_info"]["cached_tokens"] for o in outs),
        steps=steps,
        host_s=host,
        wait_s=wait,
        host_ms_per_step=1e3 * host / max(1, steps),
        host_ms_p50=1e3 * common.percentile(per_step, 50, empty=0.0),
        host_ms_p99=1e3 * common.percentile(per_step, 99, empty=0.0),
        host_frac_of_wall=host / rec["wall_s"],
        forwards_on_worker_thread=threaded,
        forwards_inline=inline,
    )
    del engine
    gc.collect()
    return rec, [o["token_ids"] for o in outs]
