"""What the scripts in benchmarks/ share: workload draws, the streaming HTTP client, statistics,
timing, the model folder, command-line defaults and the JSON + PNG output.

Imported the way ``_machine.py`` is (each script puts this folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SPECIAL_IDS = 5  # ids 0..4 are the demo tokenizer's special tokens
MODEL_NAME = "bench"  # the served model name the benchmark clusters use


# ---------------------------------------------------------------------------- presets
def presets(table: Sequence[tuple[str, Any, Any]]) -> tuple[dict, dict]:
    """``(FULL, QUICK)`` from rows of ``(setting, full value, quick value)``."""
    return {k: full for k, full, _ in table}, {k: quick for k, _, quick in table}


def fill_defaults(args: argparse.Namespace, full: dict, quick: dict) -> None:
    """Every setting the command line left unset takes its ``--quick`` or full-run value."""
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="HF model folder (default: build the demo model)")


def add_run_args(p: argparse.ArgumentParser, quick_help: str) -> None:
    """``--seed``, ``--quick`` and ``--out``, the same in every benchmark."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def check_ranges(p: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> None:
    """Each ``(MIN, MAX)`` length range needs ``1 <= MIN <= MAX``."""
    for name in names:
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')}: need 1 <= MIN <= MAX")


# ---------------------------------------------------------------------------- workload
def draw_len(rng: Any, bounds: tuple[int, int]) -> int:
    """A length uniform in ``bounds`` (both ends included)."""
    return int(rng.integers(bounds[0], bounds[1] + 1))


def random_token_ids(rng: Any, vocab_size: int, n: int) -> list[int]:
    """``n`` random token ids, special ids avoided."""
    return rng.integers(SPECIAL_IDS, vocab_size, n).tolist()


def poisson_arrivals(rng: Any, n: int, rate: float) -> Any:
    """``n`` arrival times (s): exponential gaps, the first at t=0; rate ``inf`` = all at t=0."""
    import numpy as np

    gaps = rng.exponential(1.0 / rate, n) if math.isfinite(rate) else np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n else np.zeros(0)


def warm_prompts(vocab_size: int, n: int = 2, length: int = 24) -> list[list[int]]:
    """Short prompts for untimed warm-up requests; their tokens never recur in a workload."""
    span = vocab_size - SPECIAL_IDS
    return [[SPECIAL_IDS + (7 * i + j) % span for j in range(length)] for i in range(n)]


def length_totals(reqs: list[dict]) -> dict:
    """Prompt and output token totals and means of a workload's requests."""
    ins = [len(r["input_ids"]) for r in reqs]
    outs = [r["output_len"] for r in reqs]
    return {
        "prompt_tokens": sum(ins),
        "output_tokens": sum(outs),
        "input_len_mean": sum(ins) / len(ins),
        "output_len_mean": sum(outs) / len(outs),
    }


def scheduler_flags(eargs: dict) -> list[str]:
    """Engine arguments as scheduler command-line flags (``max_total_tokens`` -> ``--max-total-tokens``)."""
    out: list[str] = []
    for k, v in eargs.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def warm_engine(engine: Any, vocab_size: int) -> None:
    """A short untimed generate (allocators, first-call paths)."""
    from radixserve import SamplingParams

    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.generate(input_ids=warm_prompts(vocab_size), sampling_params=sp)


# ------------------------------------------------------------------------------ stats
def percentile(xs: Sequence[float], q: float, empty: float = float("nan")) -> float:
    """The nearest-rank ``q``-th percentile; ``empty`` when there are no samples."""
    if not xs:
        return empty
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def ms_percentiles(
    name: str, seconds: Sequence[float], qs: Sequence[int] = (50, 99), empty: float = float("nan")
) -> dict:
    """``{name}_ms_p{q}`` for each ``q``: percentiles of samples in seconds, in ms."""
    return {f"{name}_ms_p{q}": 1e3 * percentile(seconds, q, empty) for q in qs}


def all_exact(records: list[dict]) -> bool:
    """Every request completed with exactly the output length it asked for."""
    return all(r["ok"] and r["output_tokens"] == r["expected_tokens"] for r in records)


def finite(obj: Any) -> Any:
    """NaN (a statistic of no samples) as null: the JSON stays strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


class Meter:
    """Wall time, process CPU time, 1-minute load average and minor page faults around a block."""

    def __enter__(self) -> Meter:
        self.load_before = os.getloadavg()[0]
        self.flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.cpu_s = time.process_time() - self.cpu0
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.flt0
        self.load_after = os.getloadavg()[0]

    def loadavg_before_after(self) -> list[float]:
        return [round(self.load_before, 2), round(self.load_after, 2)]


# ----------------------------------------------------------------------- HTTP client
def new_record(req: dict, **extra: Any) -> dict:
    """A request's record before it ran: nothing produced yet, not ok."""
    return {
        "arrival": req["arrival"],
        "prompt_tokens": len(req["input_ids"]),
        "expected_tokens": req["output_len"],
        "output_tokens": 0,
        "ok": False,
        "ttft": float("nan"),
        "e2e": float("nan"),
        **extra,
    }


def judge_record(rec: dict) -> None:
    """``ok``: finished by length with exactly the expected output tokens; else why not, as ``error``."""
    n, want = rec["output_tokens"], rec["expected_tokens"]
    rec["ok"] = rec["finish_reason"] == "length" and n == want
    if not rec["ok"] and rec["error"] is None:
        rec["error"] = f"finish_reason {rec['finish_reason']!r}, {n} tokens of {want}"


def completion_body(req: dict) -> dict:
    """A streamed greedy ``/v1/completions`` request: prompt as token ids, exactly ``output_len`` tokens."""
    return {
        "model": MODEL_NAME,
        "prompt": req["input_ids"],
        "max_tokens": req["output_len"],
        "temperature": 0.0,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Stream:
    """What one streamed completion delivered. ``sent``: ``perf_counter()`` at the send; ``times`` /
    ``texts``: each non-empty text chunk's arrival and text; ``end``: when the stream ended. A
    request that failed in transport (or got a non-200 answer) has ``error`` set, no chunks and no
    usage."""

    sent: float
    end: float = float("nan")
    times: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    usage: dict | None = None
    finish_reason: str | None = None
    error: str | None = None

    def failed(self, error: str) -> Stream:
        self.error = error
        self.times, self.texts, self.usage = [], [], None
        return self


async def stream_completion(
    client: Any, url: str, req: dict, start: float, first: asyncio.Event | None = None
) -> Stream:
    """Send ``req`` at ``start + req["arrival"]`` (``perf_counter`` time) and read its SSE stream;
    ``first`` is set at its first text chunk (or its end)."""
    delay = start + req["arrival"] - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    body = completion_body(req)
    stream = Stream(sent=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return stream.failed(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                payload = line[6:]
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    stream.error = str(obj["error"])[:300]
                    break
                if obj.get("usage"):
                    stream.usage = obj["usage"]
                for c in obj.get("choices") or ():
                    if c.get("text"):
                        stream.times.append(now)
                        stream.texts.append(c["text"])
                        if first is not None:
                            first.set()
                    if c.get("finish_reason"):
                        stream.finish_reason = c["finish_reason"]
        stream.end = time.perf_counter()
    except Exception as e:  # a transport error is a failed request, not a failed benchmark
        return stream.failed(f"{type(e).__name__}: {e}"[:300])
    finally:
        if first is not None:
            first.set()
    return stream


def http_client(connections: int, read_timeout_s: float) -> Any:
    """An ``httpx.AsyncClient`` with room for ``connections`` concurrent streams (and a few spare)."""
    import httpx

    n = connections + 8
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(read_timeout_s, connect=30.0))


# --------------------------------------------------------------------- model and report
def model_description(args: argparse.Namespace) -> str:
    return str(args.model) if args.model else f"demo llama/{args.model_size} (built in a temp dir)"


@contextlib.contextmanager
def demo_model_folder(size: str) -> Iterator[Path]:
    """The llama demo model of ``size`` (seed 0), built in a temporary folder for the run."""
    from radixserve.common.demo_model import make_demo_model

    with tempfile.TemporaryDirectory(prefix="radixserve-bench-") as tmp:
        yield Path(make_demo_model(Path(tmp) / "model", arch="llama", size=size, seed=0))


@contextlib.contextmanager
def model_folder(args: argparse.Namespace) -> Iterator[Path]:
    """``--model``, or the demo model of ``args.model_size`` built for the run."""
    if args.model is not None:
        yield Path(args.model)
        return
    with demo_model_folder(args.model_size) as path:
        yield path


def model_vocab_size(model_path: Path) -> int:
    return int(json.loads((model_path / "config.json").read_text())["vocab_size"])


def finish_report(report: dict, t_start: float) -> dict:
    """The load average at the end and the benchmark's total wall time (from ``t_start``)."""
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["benchmark_wall_s"] = time.perf_counter() - t_start
    return report


def write_outputs(out: Path, name: str, report: dict, plot: Callable[[Path], None]) -> tuple[Path, Path]:
    """``out/<name>.json`` (NaN as null) and ``out/<name>.png`` (drawn by ``plot``); returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(finite(report), indent=2) + "\n")
    plot(png_path)
    return json_path, png_path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rate_label(rate: float) -> str:
    """A request rate as the JSON and tables name it: "2", "0.5", "inf" (all at once)."""
    return f"{rate:g}" if math.isfinite(rate) else "inf"


def proc_cpu_seconds(stat_path: str) -> float | None:
    """User + system CPU time of a process or thread (``/proc/PID/stat``, ``/proc/PID/task/TID/stat``);
    None when it cannot be read (the process or thread ended)."""
    try:
        with open(stat_path) as f:
            fields_ = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
