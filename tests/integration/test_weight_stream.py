"""Weights streamed from S3 at load (``--load-format stream``) against a real moto S3 server: a model
fetched with ``fetch-model --skip-weights`` (the real command) serves the same greedy tokens as its
folder, with no ``*.safetensors`` on the cache; a sharded model streams shard by shard in many
ranged parts; an object replaced or truncated since the fetch, a shard missing from the store or
from the listing, a connection cut mid-part: one clear line naming the object. gs:// goes through
the same code (weight_stream.py) with gcsfs's ranged reads: test_model_source_gcs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.common.demo_model import make_demo_model
from radixserve.common.model_source import ModelSourceError
from radixserve.common.ports import free_port
from radixserve.common.weight_manifest import MANIFEST, StreamManifest
from radixserve.scheduler.model import weight_stream
from tests.helpers.s3 import BUCKET, CuttingProxy, s3_client, s3_endpoint_fixture, s3_env_fixture, upload  # noqa: F401
from tests.helpers.streamed import memory_files, sharded_copy, streamed, weights_of

pytest.importorskip("boto3", reason="pip install -e '.[test]' (boto3, moto[server])")


@pytest.fixture(autouse=True)
def _credentials(s3_env: dict[str, str]) -> None:
    """Every test here streams from the moto server (tests/helpers/s3.py's fixtures)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", arch="llama", size="tiny")


@pytest.fixture(scope="module")
def sharded_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_copy(model_dir, tmp_path_factory.mktemp("sharded") / "tiny-sharded")


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str, model_dir: Path, sharded_dir: Path) -> Any:
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    upload(client, model_dir, "llama")
    upload(client, sharded_dir, "sharded")
    return client


def fetch_without_weights(uri: str, cache: Path) -> Path:
    """The model folder ``fetch-model --skip-weights`` (the init container's command) prints."""
    cmd = [
        sys.executable,
        "-m",
        "radixserve.common.model_fetch",
        uri,
        "--cache",
        str(cache),
        "--skip-weights",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------- serving
def test_a_streamed_model_serves_its_folders_greedy_tokens_and_no_weights_touch_the_cache(
    bucket: Any, model_dir: Path, tmp_path: Path
) -> None:
    from radixserve import Engine, SamplingParams

    cache = tmp_path / "cache"
    folder = fetch_without_weights(f"s3://{BUCKET}/llama", cache)
    assert (folder / MANIFEST).is_file() and (folder / "config.json").is_file()
    params = SamplingParams(max_new_tokens=12, temperature=0)
    prompts = ["The capital of France is", "def fib(n):"]
    with Engine(model_dir, device="cpu") as engine:
        want = [o["token_ids"] for o in engine.generate(prompt=prompts, sampling_params=params)]
    with Engine(folder, device="cpu", load_format="stream") as engine:
        got = [o["token_ids"] for o in engine.generate(prompt=prompts, sampling_params=params)]
    assert got == want
    assert not list(cache.rglob("*.safetensors"))  # the weights went to memory, never to the volume


def test_a_sharded_model_streams_in_many_ranged_parts_to_the_same_weights(
    bucket: Any, sharded_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weight_stream, "HEAD_BYTES", 512)  # headers longer than the first read
    folder = fetch_without_weights(f"s3://{BUCKET}/sharded", tmp_path / "cache")
    manifest = StreamManifest.read(folder)
    assert manifest is not None
    assert sorted(f.rel for f in manifest.files) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    # At most two shards in memory at once (the one loading, the next streaming), none after.
    weights = streamed(folder, part_bytes=96 * 1024)
    assert len(weights.headers()) == 3
    held = []
    for _ in weights.shards():
        held.append(len(memory_files()))
    weights.close()
    assert held == [2, 2, 1] and memory_files() == []
    want = weights_of(sharded_dir)
    got = weights_of(folder, part_bytes=96 * 1024, parts_in_flight=3)  # ~8 parts per shard, 3 at once
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


# -------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("etag", [True, False], ids=["etag-checked", "size-only"])
def test_an_object_truncated_since_the_fetch_is_a_clear_error_naming_it(
    bucket: Any, model_dir: Path, tmp_path: Path, etag: bool
) -> None:
    prefix = f"trunc-{etag}"
    upload(bucket, model_dir, prefix)
    folder = fetch_without_weights(f"s3://{BUCKET}/{prefix}", tmp_path / "cache")
    whole = (model_dir / "model.safetensors").read_bytes()
    bucket.put_object(Bucket=BUCKET, Key=f"{prefix}/model.safetensors", Body=whole[: len(whole) // 2])
    if not etag:  # a store that records no ETag (the size is then what is checked)
        manifest = StreamManifest.read(folder)
        assert manifest is not None
        files = tuple(type(f)(f.key, f.rel, f.size, "") for f in manifest.files)
        StreamManifest(manifest.uri, files).write(folder)
    with pytest.raises(ModelSourceError) as err:
        weights_of(folder, part_bytes=256 * 1024)
    line = str(err.value)
    assert memory_files() == []  # a failed load keeps no memory
    assert "\n" not in line and line.startswith(f"s3://{BUCKET}/{prefix}/model.safetensors")
    assert f"{len(whole) // 2} bytes" in line and f"{len(whole)} bytes" in line


def test_an_object_replaced_by_one_of_the_same_size_is_refused_by_its_etag(
    bucket: Any, model_dir: Path, tmp_path: Path
) -> None:
    upload(bucket, model_dir, "replaced")
    folder = fetch_without_weights(f"s3://{BUCKET}/replaced", tmp_path / "cache")
    whole = (model_dir / "model.safetensors").read_bytes()
    other = whole[:-1] + bytes([whole[-1] ^ 1])  # another version: one byte differs, same size
    bucket.put_object(Bucket=BUCKET, Key="replaced/model.safetensors", Body=other)
    with pytest.raises(ModelSourceError) as err:
        weights_of(folder)
    assert str(err.value).startswith(f"s3://{BUCKET}/replaced/model.safetensors changed since the model was")
    assert "(fetch the model again)" in str(err.value) and memory_files() == []


def test_a_shard_missing_from_the_store_or_from_the_listing_is_named(
    bucket: Any, sharded_dir: Path, tmp_path: Path
) -> None:
    shard = "model-00002-of-00003.safetensors"
    upload(bucket, sharded_dir, "gone")
    folder = fetch_without_weights(f"s3://{BUCKET}/gone", tmp_path / "a")
    bucket.delete_object(Bucket=BUCKET, Key=f"gone/{shard}")  # deleted after the fetch
    with pytest.raises(ModelSourceError, match=f"s3://{BUCKET}/gone: no object 'gone/{shard}'"):
        weights_of(folder, part_bytes=96 * 1024)
    assert memory_files() == []
    # The scheduler fails to start with that line (and exit 1), serving nothing.
    cmd = [sys.executable, "-m", "radixserve.scheduler", "--model", str(folder), "--load-format", "stream"]
    cmd += ["--detokenizer", "localhost:1", "--port", str(free_port()), "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1
    assert f"cannot start the engine: s3://{BUCKET}/gone: no object 'gone/{shard}'" in done.stderr
    # Never uploaded: the fetch's listing lacks what the index names.
    folder = fetch_without_weights(f"s3://{BUCKET}/gone", tmp_path / "b")
    with pytest.raises(ModelSourceError, match=f"s3://{BUCKET}/gone/{shard}: not in the store when"):
        weights_of(folder, part_bytes=96 * 1024)


def test_stream_is_refused_by_name_for_models_whose_weights_are_not_in_a_store(
    model_dir: Path, tmp_path: Path
) -> None:
    from radixserve import Engine

    with pytest.raises(ValueError, match=f"--load-format stream: the model is the local folder {model_dir}"):
        Engine(model_dir, device="cpu", load_format="stream")
    # The scheduler says it before torch is imported, exit 1.
    cmd = [sys.executable, "-m", "radixserve.scheduler", "--model", str(model_dir), "--load-format", "stream"]
    cmd += ["--detokenizer", "localhost:1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "--load-format stream: the model is the local folder" in done.stderr
    # fetch-model streams nothing from the Hub.
    cmd = [sys.executable, "-m", "radixserve.common.model_fetch", "hf://Qwen/Qwen3-0.6B", "--skip-weights"]
    cmd += ["--cache", str(tmp_path), "--termination-log", str(tmp_path / "log")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert (
        (tmp_path / "log")
        .read_text()
        .startswith("hf://Qwen/Qwen3-0.6B@main: --skip-weights streams the weights from s3:// or gs:// only")
    )


@pytest.mark.parametrize(("cuts", "cut_after"), [(1, 400 << 10), (100, 100 << 10)], ids=["once", "always"])
def test_a_connection_cut_mid_part_is_read_on_or_named_after_the_last_try(
    bucket: Any,
    s3_endpoint: str,
    sharded_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cuts: int,
    cut_after: int,
) -> None:
    folder = fetch_without_weights(f"s3://{BUCKET}/sharded", tmp_path / "cache")
    host, port = s3_endpoint.removeprefix("http://").split(":")
    # Each connection broken after cut_after bytes: once (in a part, read on from there), or always
    # (every try of a ~660 KiB shard breaks, 100 KiB on: the last try's failure is the error).
    proxy = CuttingProxy((host, int(port)), cut_after=cut_after, cuts=cuts)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        if cuts == 1:  # the broken part goes on from its last byte: the same weights
            got = weights_of(folder, part_bytes=1 << 20)
            want = weights_of(sharded_dir)
            assert proxy.cut == 1 and all(torch.equal(want[k], got[k]) for k in want)
            return
        with pytest.raises(ModelSourceError) as err:
            weights_of(folder, part_bytes=1 << 20)
        assert "\n" not in str(err.value) and str(err.value).startswith(f"s3://{BUCKET}/sharded/model-0000")
    finally:
        proxy.close()
