"""Offline throughput: HF transformers ``generate`` (static batches) vs the radixserve Engine.

One seeded workload, three systems, same model, same machine, one process:

* ``hf``: ``AutoModelForCausalLM.generate``; requests in arrival order, grouped into static
  batches of ``B``, left-padded with an attention mask, greedy, ``use_cache=True``,
  ``eos_token_id=None`` (never stops early). A static batch runs until its longest request is
  done (``max_new_tokens`` = the batch's largest output length): that is the baseline's real
  cost. Only each request's own requested output tokens count as useful output; the raw number
  of generated tokens is reported too. ``B`` is the best of ``--hf-batch-sizes`` (each is run
  in full and the fastest is the baseline; every one is in the JSON).
* ``ours_normal`` / ``ours_overlap``: ``Engine(..., disable_overlap=True/False)``; every
  request submitted together to one ``generate`` call (continuous batching, radix cache,
  chunked prefill, ``page_size`` 16).

Workload: input lengths uniform in ``--input-range``, output lengths uniform in
``--output-range``, a ``--shared-prefix-frac`` of the requests start with the same
``--prefix-len``-token system prompt; random token ids (special ids 0..4 avoided),
``ignore_eos``, temperature 0, so every request produces exactly its output length.

Threads: every system runs with ``--threads`` torch intra-op threads (default 1). On the 2-vCPU
dev machine a second thread gave no matmul speedup (64x512 @ 512x1536: 1.1 ms either way) and made
wall times swing 2-7x whenever another process used a core (OpenMP stragglers); with one thread the
runs are repeatable and the overlap loop's host thread has the other core to itself.

Every system runs ``--repeats`` times, back to back in alternating order (hf, normal, overlap,
then the reverse, ...): one run moves by +-10% on the 2-core VM, more than overlap can gain there.
Ratios (ours / HF, overlap / normal) are taken within each repeat and judged on their median; each
repeat's are in the JSON (``repeats``, ``verdict``). Reported per system (its median repeat): wall
time, output tok/s (useful), total tok/s (prompt + useful output), speedup vs HF, process CPU time /
wall (under ~ the thread count means another process took CPU from this one), and for ours the
engine's non-forward host time per step
(``engine.loop.stats``: scheduling + prepare + processing) and its share of wall time.
Host-bound check (``--host-bound-pairs``, 4): on the tiny demo model, whose forwards (~1 ms) are
mostly op dispatch on the host, the normal loop against the overlap loop as the engine runs it
(while CPU forwards are shorter than ``cpu_overlap_thread_min_ms`` it steps as the normal loop:
``forwards_inline``) and against the overlap loop
with every forward forced onto its worker thread; ratios to the normal loop of the same pair.
Correctness: a few requests are re-run through HF unpadded (batch 1) and their greedy token
ids compared with ours. ``--profile`` adds a breakdown of where one normal-mode engine run
spends its time (module timers over a whole run + a torch.profiler op table of decode steps).

    .venv/bin/python benchmarks/offline [--quick] [--out DIR] [--profile]
    radixserve bench offline [same flags]

Writes DIR/offline.json and DIR/offline.png. Nothing is asserted about speed.
"""

# The modules, one job each: cli (flags and presets), workload (requests and their sampling), runners
# (HF generate and the Engine, each run once and measured), correctness (batch-1 HF check), host_bound
# (the tiny-model loop check), profiling (--profile), benchmark (the whole run and its report),
# analysis (medians, verdict, console summary), plot (the PNG).

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts here share benchmarks/_*.py
import _common as common
from _common import SPECIAL_IDS as SPECIAL_IDS  # re-exported: the tests check prompts against it

from .analysis import median_runs, print_summary, verdict
from .benchmark import run
from .cli import parse_args
from .plot import plot
from .runners import engine_args, hf_sweep, load_hf
from .workload import build_workload, greedy, greedy_sampling, workload_summary

# The command line, and what the tests and benchmarks/gpu use.
__all__ = [
    "SPECIAL_IDS",
    "build_workload",
    "engine_args",
    "greedy",
    "greedy_sampling",
    "hf_sweep",
    "load_hf",
    "main",
    "median_runs",
    "parse_args",
    "run",
    "verdict",
    "workload_summary",
]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path, png_path = common.write_outputs(
        args.out,
        "offline",
        report,
        lambda path: plot(report["results"], path, report["verdict"], report.get("host_bound")),
    )
    print_summary(report)
    print(f"wrote {json_path} and {png_path}")
    return 0
