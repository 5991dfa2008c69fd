"""Weights streamed from S3 at load (``--load-format stream``) against today's download-then-load,
on a local moto S3 server (the tests' store: real HTTP on loopback, but moto serves slowly, so the
figures check that streaming works end to end and what it costs beside the download, not a real
store's speed).

A generated Llama-shaped bf16 model of ``--gen-gb`` GB (benchmarks/cold_start.py's) is uploaded to
moto, then, each into a fresh cache folder:

* download: ``fetch-model`` (the whole model onto the cache), then the loader reads the folder;
* stream: ``fetch-model --skip-weights`` (the small files), then the loader streams the weights
  (model/weight_stream.py: ranged GETs into memory files, the next shard while one loads);
* the store alone: the same streams, the shards dropped unread (what moto serves at).

    python benchmarks/stream_weights.py [--gen-gb 0.2] [--out DIR]

Writes OUT/stream_weights.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(
    str(Path(__file__).resolve().parents[1])
)  # tests/helpers; appended: operator/ shadows a module
from _machine import machine_info

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _fetch(uri: str, cache: Path, weights: bool) -> tuple[Path, float]:
    from dataclasses import replace

    from radixserve.common.model_cache import ModelCache
    from radixserve.common.model_fetch import fetch
    from radixserve.common.model_source import parse_model_uri

    t0 = time.perf_counter()
    result = fetch(replace(parse_model_uri(uri), weights=weights), ModelCache(cache, 1 << 40), log=print)
    return result.model_dir, time.perf_counter() - t0


def _load(folder: Path) -> float:
    from radixserve.scheduler.model.config import ModelConfig
    from radixserve.scheduler.model.loader import load_model

    t0 = time.perf_counter()
    model = load_model(folder, ModelConfig.from_pretrained(folder), "cpu")
    seconds = time.perf_counter() - t0
    del model
    return seconds


def _store_only(folder: Path) -> float:
    from radixserve.scheduler.model.weight_stream import StreamedWeights

    weights = StreamedWeights.of(folder)
    t0 = time.perf_counter()
    try:
        for _ in weights.shards():
            pass
    finally:
        weights.close()
    return time.perf_counter() - t0


def run(model: Path, work: Path, endpoint: str) -> dict[str, Any]:
    from radixserve.common.model_source import tree_files
    from tests.helpers.s3 import BUCKET, s3_client, upload

    client = s3_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    upload(client, model, "gen")
    uri = f"s3://{BUCKET}/gen"
    weights = sum((model / r).stat().st_size for r in tree_files(model) if r.endswith(".safetensors"))
    folder, fetch_s = _fetch(uri, work / "download", weights=True)
    download = {"fetch_s": fetch_s, "load_s": _load(folder)}
    folder, fetch_s = _fetch(uri, work / "stream", weights=False)
    stream = {"fetch_s": fetch_s, "load_s": _load(folder), "store_only_s": _store_only(folder)}
    on_volume = sum(p.stat().st_size for p in (work / "stream").rglob("*.safetensors"))
    for r in (download, stream):
        r["total_s"] = r["fetch_s"] + r["load_s"]
    return {
        "weight_bytes": weights,
        "download_then_load": download,
        "stream": stream,
        "stream_weight_bytes_on_the_cache_volume": on_volume,
        "store_rate_mib_s": weights / 2**20 / stream["store_only_s"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gen-gb", type=float, default=0.2, help="the generated model's size")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    from cold_start import generated_model

    from tests.helpers.s3 import CREDENTIALS, moto_server

    work = Path(tempfile.mkdtemp(prefix="radixserve-bench-stream-"))
    model = generated_model(
        Path(tempfile.gettempdir()) / f"radixserve-bench-stream-gen-{args.gen_gb:g}", args.gen_gb
    )
    with moto_server() as endpoint:
        os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
        results = {"machine": machine_info(), "gen_gb": args.gen_gb, **run(model, work, endpoint)}
    print(json.dumps(results, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_weights.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'stream_weights.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
