"""Online serving: the HTTP server (``radixserve serve``) vs the same Engine in-process.

Two workload shapes, two systems, same model, same engine arguments, same machine:

* ``served``: ``launcher.build_cluster`` (gateway + 1 scheduler process + detokenizer, gRPC between
  them, the scheduler with ``--threads`` torch threads); every request is streamed from this process
  over HTTP (``httpx.AsyncClient``, ``POST /v1/completions``, ``stream: true``,
  ``stream_options.include_usage``), prompt sent as token ids, ``max_tokens`` = output length.
* ``inprocess``: ``Engine(model, **same engine args)`` in this process (``torch.set_num_threads``),
  driven by a loop that adds each ``Req`` when it is due and calls ``engine.loop.step()``; after
  each step, a request whose known output length grew got those tokens at that moment.

Poisson (open loop): for each rate (``--rates``, req/s; ``inf`` = every request at t=0, i.e.
saturation), ``N`` requests with exponential inter-arrival gaps (first request at t=0).

Closed loop: for each concurrency ``C`` (``--concurrency``), ``C * --requests-per-client`` requests;
client ``j`` runs requests ``j, j + C, j + 2C, ...`` back to back: served, the next HTTP request
starts as soon as the previous stream has ended; in-process, the next ``Req`` is added right after
the step that finished the previous one (it joins at the next step). All clients start at t=0. The
running batch stays ~C in both systems (``mean_in_flight``, Little's law, says how close), so the
served - in-process latency difference is the split's per-step cost, not a drift in batch
composition (which is what makes the Poisson ITL difference past saturation noisy).

Requests (both shapes): random prompt token ids (special ids 0..4 avoided; a fresh draw per rate
and per concurrency so nothing hits the radix cache), input and output lengths uniform in
``--input-range`` / ``--output-range``; greedy, ``ignore_eos``, so every request produces exactly
its output length (checked). Served requests also set ``skip_special_tokens: false`` so a sampled
special token still produces a text chunk.

Per request (times from the request's arrival: in-process the scheduled time (Poisson) or the time
it was added (closed loop); served the moment the HTTP request is started):

* TTFT: time to the first non-empty text chunk (served) / the step that produced the first token.
* ITL, per token: a chunk (or engine step) that delivers ``k`` tokens ``g`` seconds after the
  previous one contributes ``k`` samples of ``g / k``. In-process ``k`` is exact (normal loop: 1).
  The SSE chunks carry text, not token counts: when a request's content-chunk count equals
  ``usage.completion_tokens`` every chunk is one token and the samples are exact; otherwise (the
  detokenizer held back a partial UTF-8 character, so some chunk carried 2+ tokens) the surplus is
  assigned by ``chunk_tokens`` (to the chunks with non-ASCII text); such requests are counted
  (``requests_multi_token_chunks``, ``chunk_tokens_estimated_requests``).
* TPOT = (e2e - TTFT) / (N - 1), exact for both; e2e = time to the last token / ``[DONE]``.

Per run and system: TTFT / ITL / TPOT / e2e p50 and p99, output tok/s and req/s over the makespan
(first arrival to last completion); served / in-process throughput ratio and the served -
in-process ITL / TPOT / TTFT medians (ms). Targets (measured, never asserted): at saturation
(Poisson rate ``inf``, else the highest rate) served output throughput >= 0.9x in-process; the
split adds <= 2 ms to median ITL, judged on the closed loops: served - in-process ITL p50 <= 2 ms
at every concurrency (TPOT p50 is reported beside it, and so are the Poisson differences). Each
concurrency runs ``--repeats`` times (a fresh draw each), the two systems back to back on the same
draw; the judged difference is the median over repeats of those paired differences. One pair moves
by 1-2 ms between repeats on this 2-core VM, more than the effect measured.

    .venv/bin/python benchmarks/serving [--quick] [--out DIR] [--rates 1 2 4 inf]
        [--concurrency 1 8 32] ...
    radixserve bench serving [same flags]

Writes DIR/serving.json and DIR/serving.png.
"""

# The modules, one job each: settings (systems, targets, presets), cli (flags), workload (requests
# and engine arguments), served (the HTTP client), inprocess (the engine loop), runner (both
# systems on every workload), sweep (the workloads and the report), analysis (summaries and the
# verdict), table (the console report), plot (the PNG).

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks share benchmarks/_*.py
import _common as common
from _common import SPECIAL_IDS, rate_label  # part of the package's names (the tests use some)

from .analysis import compare, itl_samples, median_summary, public_record, summarize
from .cli import parse_args
from .plot import plot
from .runner import run_both
from .served import chunk_tokens
from .settings import FULL, QUICK, SYSTEMS, TARGET_ITL_ADDED_MS, TARGET_THROUGHPUT_RATIO
from .sweep import run
from .table import format_table
from .workload import (
    build_closed_workload,
    build_workload,
    closed_seed,
    engine_args,
    parse_rate,
    rate_seed,
    workload_summary,
)

__all__ = [
    "FULL",
    "QUICK",
    "SPECIAL_IDS",
    "SYSTEMS",
    "TARGET_ITL_ADDED_MS",
    "TARGET_THROUGHPUT_RATIO",
    "build_closed_workload",
    "build_workload",
    "chunk_tokens",
    "closed_seed",
    "compare",
    "engine_args",
    "format_table",
    "itl_samples",
    "main",
    "median_summary",
    "parse_args",
    "parse_rate",
    "plot",
    "public_record",
    "rate_label",
    "rate_seed",
    "run",
    "run_both",
    "summarize",
    "workload_summary",
]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    labels, conc = report["config"]["rates"], report["config"]["concurrency"]
    verdict = report["verdict"]
    json_path, png_path = common.write_outputs(
        args.out, "serving", report, lambda path: plot(report["results"], labels, conc, verdict, path)
    )
    print(format_table(report["results"], labels, conc, report["verdict"]))
    print(f"wrote {json_path} and {png_path}")
    return 0
