"""Cold start, phase by phase: how long a scheduler takes from exec to serving, where the time goes,
how fast the loader reads the weights against the raw read rate of the same files, and what a request
held at the gateway waits for when the first scheduler starts only after it came.

For each model (the demo model, and a generated Llama-shaped bf16 model of ``--gen-gb`` GB written
under the temp dir, never the repository):

* read rates, the page cache warm and then cold (the files' pages dropped with posix_fadvise
  DONTNEED, which needs no privilege): ``cat FILES > /dev/null``; the loader (model/loader.py,
  parallel preads into the parameters); the loader's previous path (safetensors' mmap reads, the
  same code with the pread path turned off); and the rate this machine fills new memory at (pread
  into a fresh buffer: the floor of any loader that must put the weights into new memory);
* the phases a scheduler process reports (``radixserve_startup_seconds{phase}``);
* (``--held``) a streamed request sent to a gateway with no scheduler (``--hold-timeout``), the
  scheduler started after it: its time to first token, and the cold start inside it.

    radixserve bench cold_start [--quick] [--gen-gb 1.1] [--out DIR]

Writes OUT/cold_start.json and OUT/cold_start.png. Target (issue 40): the loader within 1.5x of the
raw read rate with a warm page cache (and a cold one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MODEL_NAME = "bench"


# ---------------------------------------------------------------------------- models
def generated_model(folder: Path, gb: float) -> Path:
    """A random-weight Llama-shaped bf16 model of about ``gb`` GB (hidden 2048, GQA 16/4 heads)."""
    from transformers import LlamaConfig

    from radixserve.common.demo_model import save_random_model

    per_layer = 2 * (2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 5632)  # bytes: attention + MLP
    layers = max(1, round(gb * 1e9 / per_layer))
    if (folder / "config.json").is_file():
        return folder

    def config(vocab: int, ids: dict[str, Any]) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
            num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
            tie_word_embeddings=False, dtype="bfloat16", **ids,
        )  # fmt: skip

    return save_random_model(folder, config, "bfloat16")


# ---------------------------------------------------------------------------- read rates
def drop_from_page_cache(files: Sequence[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_cat(files: Sequence[Path]) -> float:
    t = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def time_loader(path: Path, variant: str = "now") -> float:
    """Seconds ``load_model`` takes on CPU and then a read of every 4 KiB page of every parameter
    (a parameter mapped from the file is read from it only then: its first use is part of its load).
    ``variant`` "pread": no parameter mapped (every tensor taken whole read with pread: the loader
    of the previous round); "mmap_before": no pread either (every tensor through safetensors' own
    reads, the loader before issue 40)."""
    import torch

    from radixserve.scheduler.model import loader
    from radixserve.scheduler.model.config import ModelConfig

    cfg = ModelConfig.from_pretrained(path)
    real_header, real_map = loader.read_header, loader.ParallelReads._map_whole_parameters
    if variant in ("pread", "mmap_before"):
        loader.ParallelReads._map_whole_parameters = lambda self: None  # type: ignore[method-assign]
    if variant == "mmap_before":
        loader.read_header = lambda file: {}  # type: ignore[assignment]
    try:
        t = time.perf_counter()
        model = loader.load_model(path, cfg, "cpu")
        for p in model.parameters():
            p.detach().reshape(-1).view(torch.uint8)[::4096].sum()
        seconds = time.perf_counter() - t
    finally:
        loader.read_header = real_header  # type: ignore[assignment]
        loader.ParallelReads._map_whole_parameters = real_map  # type: ignore[method-assign]
    del model
    return seconds


def time_fresh_memory(files: Sequence[Path]) -> float:
    """Seconds to pread the files into new memory (a fresh buffer each): this machine's floor for
    putting weights into memory that was not there before."""
    import torch

    t = time.perf_counter()
    for f in files:
        buf = torch.empty(f.stat().st_size, dtype=torch.uint8)
        view, fd, done = memoryview(buf.numpy()), os.open(f, os.O_RDONLY), 0
        try:
            while done < len(view):
                done += os.preadv(fd, [view[done : done + (64 << 20)]], done)
        finally:
            os.close(fd)
        del buf
    return time.perf_counter() - t


def read_rates(path: Path, reps: int) -> dict[str, Any]:
    from radixserve.scheduler.model.weight_files import safetensor_files

    files = safetensor_files(path)
    size = sum(f.stat().st_size for f in files)
    out: dict[str, Any] = {"bytes": size}
    for cache in ("warm", "cold"):
        row: dict[str, float] = {}
        for what, run in (
            ("cat", lambda: time_cat(files)),
            ("loader", lambda: time_loader(path)),
            ("loader_pread", lambda: time_loader(path, "pread")),
            ("loader_mmap_before", lambda: time_loader(path, "mmap_before")),
            ("fresh_memory", lambda: time_fresh_memory(files)),
        ):
            best = float("inf")
            for _ in range(reps):
                if cache == "cold":
                    drop_from_page_cache(files)
                else:
                    time_cat(files)  # warm
                best = min(best, run())
            row[f"{what}_s"] = round(best, 4)
            row[f"{what}_gb_per_s"] = round(size / best / 1e9, 3)
        row["loader_over_cat"] = round(row["loader_s"] / row["cat_s"], 2)
        row["loader_pread_over_cat"] = round(row["loader_pread_s"] / row["cat_s"], 2)
        row["loader_mmap_before_over_cat"] = round(row["loader_mmap_before_s"] / row["cat_s"], 2)
        row["loader_over_fresh_memory"] = round(row["loader_s"] / row["fresh_memory_s"], 2)
        out[cache] = row
    return out


# ---------------------------------------------------------------------------- processes
def _metrics_phases(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(url, timeout=5).text
    return {
        line.split('phase="')[1].split('"')[0]: round(float(line.rsplit(" ", 1)[1]), 3)
        for line in text.splitlines()
        if line.startswith("radixserve_startup_seconds{")
    }


def _wait(check: Any, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        time.sleep(0.05)


def held_cold_start(path: Path, max_tokens: int) -> dict[str, Any]:
    """A gateway that holds (no scheduler yet), one streamed request, then the scheduler: the
    request's TTFT (client side), its held time (the gateway's), and the scheduler's phases."""
    import httpx

    from radixserve.launcher import build_cluster, free_port

    cluster = build_cluster(
        path, MODEL_NAME, port=free_port(), schedulers=1, torch_threads=max(1, (os.cpu_count() or 2) - 1),
        gateway_args=["--hold-timeout", "300", "--router", "round-robin"],
    )  # fmt: skip
    sched = cluster.schedulers[0]
    try:
        for s in (cluster.detokenizer, cluster.gateway):
            s.start()
        _wait(lambda: _health(cluster.url) == "holding", 120, "the gateway to hold")

        async def one() -> dict[str, float]:
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens, "stream": True}
            body |= {"temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=cluster.url, timeout=600) as h:
                t0 = time.perf_counter()
                request = asyncio.create_task(_stream(h, body))
                while _held(cluster.url) < 1:
                    await asyncio.sleep(0.02)
                t_start = time.perf_counter()
                sched.start()  # the first scheduler, started only now
                first, end = await request
                return {"ttft_s": first - t0, "start_to_first_token_s": first - t_start, "e2e_s": end - t0}

        got = asyncio.run(one())
        got["scheduler_phases"] = phases = _metrics_phases(sched.metrics_url or "")
        # After the scheduler serves: its gRPC server up, the gateway's stream to it (re)opened, the
        # held request routed, prefilled and its first token back.
        got["serving_to_first_token_s"] = got["start_to_first_token_s"] - sum(phases.values())
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in got.items()}
    finally:
        cluster.stop(drain_timeout=2)


async def _stream(h: Any, body: dict) -> tuple[float, float]:
    first = None
    async with h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter()
    assert first is not None
    return first, time.perf_counter()


def _health(url: str) -> str:
    import httpx

    try:
        return str(httpx.get(f"{url}/health", timeout=2).json().get("status"))
    except (httpx.HTTPError, ValueError):
        return ""


def _held(url: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=2).text.splitlines():
        if line.startswith("radixserve_held_requests{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def scheduler_phases(path: Path) -> dict[str, float]:
    """A scheduler process alone, started and stopped: the phases it reports."""
    from radixserve.common.ports import free_ports

    port, metrics = free_ports(2)
    argv = [sys.executable, "-m", "radixserve.scheduler", "--model", str(path), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--metrics-port", str(metrics), "--detokenizer", "127.0.0.1:1"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{metrics}/metrics"

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the scheduler exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}"
                )
            try:
                return bool(_metrics_phases(url))
            except Exception:
                return False

        _wait(ready, 600, "the scheduler to start")
        return _metrics_phases(url)
    finally:
        proc.terminate()
        proc.wait(30)


# ---------------------------------------------------------------------------- output
def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from radixserve.scheduler.startup import PHASES

    names = list(results["models"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    bottom = [0.0] * len(names)
    for phase in PHASES:
        vals = [results["models"][n]["phases"].get(phase, 0.0) for n in names]
        a.bar(names, vals, bottom=bottom, label=phase)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    a.set_ylabel("seconds")
    a.set_title("scheduler start, by phase")
    a.legend(fontsize=8)
    kinds = ("cat", "loader", "loader_pread", "loader_mmap_before", "fresh_memory")
    width = 0.16
    labels = [f"{n}\n{c}" for n in names for c in ("warm", "cold")]
    for i, kind in enumerate(kinds):
        vals = [results["models"][n]["read"][c][f"{kind}_gb_per_s"] for n in names for c in ("warm", "cold")]
        b.bar([x + i * width for x in range(len(labels))], vals, width, label=kind)
    b.set_xticks([x + 2 * width for x in range(len(labels))], labels, fontsize=8)
    b.set_ylabel("GB/s")
    b.set_title("weights read rate: cat vs the loader (now, pread only, before) vs new memory")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 0.05 GB generated model, one repetition")
    ap.add_argument("--gen-gb", type=float, default=None, help="the generated model's size (default 1.1)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per read measurement (best kept)")
    ap.add_argument("--no-held", action="store_true", help="skip the held request's cold start")
    ap.add_argument("--no-demo", action="store_true", help="only the generated model")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    gen_gb = args.gen_gb if args.gen_gb is not None else (0.05 if args.quick else 1.1)
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    from radixserve.common.demo_model import make_demo_model

    work = Path(tempfile.gettempdir()) / "radixserve-bench-cold-start"
    models = {} if args.no_demo else {"demo": work / "demo"}
    if not args.no_demo and not (work / "demo/config.json").is_file():
        make_demo_model(work / "demo")
    models[f"generated-{gen_gb:g}GB"] = generated_model(work / f"gen-{gen_gb:g}", gen_gb)
    results: dict[str, Any] = {"machine": machine_info(), "models": {}}
    for name, path in models.items():
        print(f"{name}: read rates", flush=True)
        read = read_rates(path, reps)
        print(f"{name}: scheduler phases", flush=True)
        results["models"][name] = {"path": str(path), "read": read, "phases": scheduler_phases(path)}
        print(json.dumps(results["models"][name], indent=1), flush=True)
    if not args.no_held:
        for name, path in models.items():
            print(f"{name}: a held request's cold start", flush=True)
            results["models"][name]["held_request"] = held_cold_start(path, max_tokens=4)
            print(json.dumps(results["models"][name]["held_request"], indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_start.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "cold_start.png")
    print(f"wrote {args.out / 'cold_start.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
