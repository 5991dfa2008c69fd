"""GPU decode benchmark: how close the Engine's decode step is to the memory floor, how many kernels a
step launches, and the Engine's offline throughput against HF ``generate``, all in one process.

The model is random-weight Qwen3-0.6B shapes (28 layers, hidden 1024, 16 q / 8 kv heads of 128,
MLP 3072, vocab 151936, tied embeddings) in bfloat16, built with ``save_pretrained`` in a temporary
folder with the demo model's tokenizer (prompt ids are drawn below the tokenizer's vocab; the
model's vocab stays 151936). The stages, in the order they run (``--stages`` picks some):

* ``bandwidth``: ``d2d_gbps``, device-to-device copy bandwidth, ``dst.copy_(src)`` of a 1 GiB tensor
  timed with ``torch.cuda.Event`` (best of a few rounds); a copy reads and writes, so 2 x bytes / time.
* ``decode_graphs`` / ``decode_eager``: ``decode_ms_bs{1,8,64}`` (CUDA graphs on) and ``..._eager``
  (``disable_cuda_graph=True``): B requests with ``--prompt-len`` token prompts decode
  ``--decode-steps`` tokens together on the normal loop (``disable_overlap=True``), so a step is
  schedule + prepare + forward + sync + process; ``Engine.generate``'s ``on_step`` times every
  step (host time) and the median over the steps whose batch is a decode batch of all B requests is reported.
  Beside it, from CUDA events around every forward of those steps (the loop's GPU trace),
  ``decode_gpu_ms_bs{B}`` (the GPU's own time per step) and ``decode_gpu_idle_ms_bs{B}`` (the
  GPU's idle gap before a step: host work nothing hid), with ``_eager`` variants; None on CPU.
  ``floor_ms_bs1``: (bytes of every weight + bytes of KV one bs-1 decode step reads at the median
  context of the timed steps) / ``d2d_gbps``: the time just to read what a step must read.
  ``kernels_per_decode_step`` (and ``/ num_layers`` as ``kernels_per_layer``): with graphs off, a
  few decode steps under ``torch.profiler`` (CPU + CUDA activities); CUDA kernel events, memcpy and
  memset excluded, per step. ``kernel_count_method`` says what was counted.
* ``offline_overlap`` / ``hf``: ``offline_tok_s`` / ``hf_tok_s``: ``--num-requests`` (256)
  requests with input and output lengths uniform in 100..1024 (seeded), greedy, ``ignore_eos``:
  ours is one ``Engine.generate`` call with all of them (overlap loop, graphs on); HF is
  ``AutoModelForCausalLM.generate`` in static, left-padded batches (benchmarks/offline's approach;
  the best of ``--hf-batch-sizes``), counting only each request's own output tokens.
  ``speedup_vs_hf`` = ours / HF. nano-vllm's published figure for the same workload (1434 tok/s,
  RTX 4070, a different GPU) is in the JSON for reference.
* ``offline_normal``: ``overlap_speedup``, the same workload on the overlap loop over the normal loop.
* ``gpu_trace``: the workload again on the overlap loop with ``engine.loop.enable_gpu_trace()``;
  per step the GPU's busy time and its idle time since the previous step ended; reported as
  ``gpu_idle_ms_p50`` / ``p90``, ``gpu_idle_frac`` = idle / (idle + busy), and up to 2,000 steps.

    .venv/bin/python benchmarks/gpu [--device cuda] [--preset check] [--out DIR]
    .venv/bin/python benchmarks/gpu --smoke [--out DIR]       # tiny model on CPU, < 1 min
    radixserve bench gpu [same flags]

``--arch qwen3_moe`` runs the same stages on Qwen3-0.6B's attention with 64-expert MoE layers
(model.py ``QWEN3_MOE``) and writes gpu-<device>-qwen3_moe.json; its decode stages give the MoE
model's step time at batch 1, 8 and 64 (scripts/gpu-check phase2 --arch qwen3_moe runs just those).

Writes DIR/gpu-<device>.json (e.g. gpu-nvidia-h200.json; default DIR benchmarks/results) after every
stage, ``partial`` (true until every stage is done; ``stages`` says which are done, failed or not
run; a failed stage is reported and the next one runs), and a PNG beside it at the end, with a
``targets`` dict (decode at bs 1 within 2x the floor, <= 15 kernels a layer, >= 10x HF, overlap >=
1.15x the normal loop). ``--preset check`` is every stage at the sizes scripts/gpu-check's phase 2
runs in one device command (64 requests, prompts 64-512, outputs 64-256, graph buckets up to 64).
The GPU figures come only from a run on a GPU machine. ``--smoke`` runs every part end to end on CPU
with a tiny Qwen3 and tiny request counts so the script is known to work: there the copy bandwidth
is a host memcpy, the "kernel" count is top-level torch ops per step, there is no GPU trace, and no
target is judged.
"""

# The modules, one job each: cli (flags and presets), model (the random-weight model and its Engine),
# device (sync, free, name, copy bandwidth), decode (step times), kernels (kernels per step),
# throughput (offline runs vs HF, the idle trace), stages (what runs in which order, failures kept),
# report (the whole run, its report and targets), plot (the PNG).

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts here share benchmarks/_*.py
import _common as common

from .cli import parse_args
from .decode import BATCH_SIZES
from .device import device_name, device_slug
from .plot import plot
from .report import judge, run
from .throughput import idle_stats

# The command line, and what the tests use.
__all__ = ["device_slug", "idle_stats", "judge", "main", "parse_args", "run"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    arch = "" if args.arch == "qwen3" else f"-{args.arch}"  # the MoE model's report beside the dense one's
    json_path = args.out / f"gpu-{device_slug(device_name(args.device))}{arch}.json"
    report = run(args, write=lambda r: write_json(json_path, r))
    write_json(json_path, report)
    png_path = json_path.with_suffix(".png")
    plot(report, png_path)
    keys = [f"decode_{k}bs{b}{s}" for s in ("", "_eager") for k in ("ms_", "gpu_ms_") for b in BATCH_SIZES]
    keys += ["floor_ms_bs1", "d2d_gbps", "kernels_per_decode_step", "kernels_per_layer"]
    keys += [
        "offline_tok_s",
        "hf_tok_s",
        "speedup_vs_hf",
        "overlap_speedup",
        "gpu_idle_ms_p50",
        "gpu_idle_frac",
    ]
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    print("targets:", json.dumps(report["targets"]))
    print("stages:", json.dumps(report["stages"]))
    print(f"wrote {json_path} and {png_path}")
    return 1 if any(s.startswith("failed") for s in report["stages"].values()) else 0


def write_json(path: Path, report: dict[str, Any]) -> None:
    """The report, replacing the previous one whole: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(common.finite(report), indent=2) + "\n")
    tmp.replace(path)
