"""gs:// models against a real GCS server: gcp-storage-emulator (the JSON API over real HTTP, in
memory, a child process on a free loopback port: tests/helpers/gcs.py), found by the code under
test through ``STORAGE_EMULATOR_HOST`` and used anonymously. A model is fetched by the real command
(``python -m radixserve.common.model_fetch``) and serves its folder's greedy tokens, whole or with
its weights streamed (``--skip-weights`` and ``--load-format stream``); an object replaced or
truncated since the fetch, deleted from the store, a missing bucket or prefix: one line naming it.

The emulator serves an object's live generation whatever generation a read asks for: what refuses
a replaced object here is GcsStore's metadata check before an object's first read, and after a read
that ends early; GCS's 404 for a generation that is gone is not exercised (model_stores.GcsStore).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.common.model_source import ModelSourceError, parse_model_uri, tree_digest
from radixserve.common.model_stores import open_store
from radixserve.common.ports import free_port
from radixserve.common.weight_manifest import MANIFEST
from tests.helpers.gcs import BUCKET, gcs_client, gcs_emulator, upload
from tests.helpers.streamed import memory_files, sharded_copy, weights_of

pytest.importorskip("gcsfs", reason="pip install -e '.[test]' (gcsfs, gcp-storage-emulator)")

PROMPTS = ["The capital of France is", "def fib(n):"]


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator")
    with gcs_emulator() as url:
        yield url


@pytest.fixture(autouse=True)
def gcs_env(emulator: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What points the code under test (and the fetchers it starts) at the emulator."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)


@pytest.fixture(scope="module")
def model_dir(demo_model: Callable[..., Path]) -> Path:
    return demo_model("llama", "tiny")


@pytest.fixture(scope="module")
def sharded_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_copy(model_dir, tmp_path_factory.mktemp("sharded") / "tiny-sharded")


@pytest.fixture(scope="module")
def bucket(emulator: str, model_dir: Path, sharded_dir: Path) -> Any:
    """The bucket, with the tiny model under llama/ and in three shards under sharded/."""
    fs = gcs_client(emulator)
    fs.mkdir(BUCKET)
    upload(fs, model_dir, "llama")
    upload(fs, sharded_dir, "sharded")
    return fs


@pytest.fixture(scope="module")
def folder_tokens(model_dir: Path) -> list[list[int]]:
    """The local folder's greedy tokens: what every copy from the store must serve."""
    return greedy_tokens(model_dir)


def greedy_tokens(folder: Path, **engine: Any) -> list[list[int]]:
    from radixserve import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=12, temperature=0)
    with Engine(folder, device="cpu", **engine) as e:
        return [o["token_ids"] for o in e.generate(prompt=PROMPTS, sampling_params=params)]


def fetch_cli(*args: str, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "radixserve.common.model_fetch", *args]
    if log is not None:
        cmd += ["--termination-log", str(log)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ))


def fetched(uri: str, cache: Path, *args: str) -> Path:
    """The model folder fetch-model prints."""
    done = fetch_cli(uri, "--cache", str(cache), *args)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ serving
def test_a_gcs_model_is_fetched_once_and_serves_its_folders_greedy_tokens(
    bucket: Any, model_dir: Path, folder_tokens: list[list[int]], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    first = fetch_cli(f"gs://{BUCKET}/llama", "--cache", str(cache))
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip().splitlines()[-1])
    assert folder == cache / parse_model_uri(f"gs://{BUCKET}/llama").relative_model_dir()
    assert tree_digest(folder) == tree_digest(model_dir) and "downloading 6 objects" in first.stderr
    assert greedy_tokens(folder) == folder_tokens
    # Again, with the emulator's address dead: a complete entry is used without asking the store.
    dead = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"}
    cmd = [
        sys.executable,
        "-m",
        "radixserve.common.model_fetch",
        f"gs://{BUCKET}/llama",
        "--cache",
        str(cache),
    ]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dead)
    assert second.returncode == 0 and Path(second.stdout.strip()) == folder, second.stderr
    assert "found in the cache" in second.stderr


def test_streamed_weights_serve_the_folders_greedy_tokens_and_never_touch_the_cache(
    bucket: Any, folder_tokens: list[list[int]], sharded_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    folder = fetched(f"gs://{BUCKET}/llama", cache, "--skip-weights")
    assert (folder / MANIFEST).is_file() and (folder / "config.json").is_file()
    assert greedy_tokens(folder, load_format="stream") == folder_tokens
    # Three shards in ~96 KiB ranged reads, three in flight: the very weights of the folder.
    sharded = fetched(f"gs://{BUCKET}/sharded", cache, "--skip-weights")
    want = weights_of(sharded_dir)
    got = weights_of(sharded, part_bytes=96 * 1024, parts_in_flight=3)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not list(cache.rglob("*.safetensors")) and memory_files() == []


# ------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("change", ["replaced", "truncated"])
def test_an_object_changed_since_the_fetch_is_refused_naming_it(
    bucket: Any, model_dir: Path, tmp_path: Path, change: str
) -> None:
    upload(bucket, model_dir, change)
    folder = fetched(f"gs://{BUCKET}/{change}", tmp_path / "cache", "--skip-weights")
    whole = (model_dir / "model.safetensors").read_bytes()
    # Another version of the same size (one byte differs), or the first half only.
    other = whole[:-1] + bytes([whole[-1] ^ 1]) if change == "replaced" else whole[: len(whole) // 2]
    bucket.pipe_file(f"{BUCKET}/{change}/model.safetensors", other)
    with pytest.raises(ModelSourceError) as err:
        weights_of(folder, part_bytes=256 * 1024)
    line = str(err.value)
    assert "\n" not in line and memory_files() == []  # a failed load keeps no memory
    assert line.startswith(f"gs://{BUCKET}/{change}/model.safetensors changed since the model was fetched: ")
    assert f"{len(other)} bytes, generation " in line and f"said {len(whole)} bytes" in line
    assert line.endswith("(fetch the model again)")


def test_an_object_truncated_while_it_streams_is_refused_when_a_read_ends_early(
    bucket: Any, model_dir: Path
) -> None:
    upload(bucket, model_dir, "midway")
    store = open_store(parse_model_uri(f"gs://{BUCKET}/midway"))
    (file,) = (f for f in store.list() if f.rel == "model.safetensors")
    whole = (model_dir / "model.safetensors").read_bytes()
    assert b"".join(store.read(file, 100, 200)) == whole[100:200]  # the object checked, as listed
    bucket.pipe_file(f"{BUCKET}/midway/model.safetensors", whole[:1000])
    with pytest.raises(ModelSourceError, match=r"midway/model.safetensors changed since .*: 1000 bytes"):
        b"".join(store.read(file, 500, 1500))


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("gs://no-such-bucket/llama", "gs://no-such-bucket/llama: bucket 'no-such-bucket' does not exist"),
        (f"gs://{BUCKET}/absent", f"gs://{BUCKET}/absent: no objects under the prefix absent/"),
        (f"gs://{BUCKET}/llam", f"gs://{BUCKET}/llam: no objects under the prefix llam/"),  # not llama/
    ],
)
def test_a_missing_bucket_or_prefix_fails_with_one_line_in_the_termination_log(
    bucket: Any, tmp_path: Path, uri: str, message: str
) -> None:
    log = tmp_path / "termination-log"
    out = fetch_cli(uri, "--cache", str(tmp_path / "cache"), log=log)
    assert out.returncode == 1 and out.stdout == ""
    assert log.read_text() == message + "\n"
    assert out.stderr.strip().splitlines()[-1] == f"fetch-model: {message}"


def test_a_shard_deleted_since_the_fetch_is_named(bucket: Any, sharded_dir: Path, tmp_path: Path) -> None:
    shard = "model-00002-of-00003.safetensors"
    upload(bucket, sharded_dir, "gone")
    folder = fetched(f"gs://{BUCKET}/gone", tmp_path / "cache", "--skip-weights")
    bucket.rm_file(f"{BUCKET}/gone/{shard}")
    with pytest.raises(ModelSourceError) as err:
        weights_of(folder, part_bytes=96 * 1024)
    assert str(err.value) == f"gs://{BUCKET}/gone: no object 'gone/{shard}' in bucket '{BUCKET}'"
    assert memory_files() == []


def test_the_emulator_means_anonymous_access_and_only_the_emulator_does(
    bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A key file named but absent: no matter with the emulator (no credentials are used) ...
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "service-account.json"))
    listed = open_store(parse_model_uri(f"gs://{BUCKET}/llama")).list()
    assert "config.json" in {f.rel for f in listed}
    # ... and the clear error it always was against GCS itself.
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    with pytest.raises(
        ModelSourceError, match=r"GOOGLE_APPLICATION_CREDENTIALS names .*, which does not exist"
    ):
        open_store(parse_model_uri(f"gs://{BUCKET}/llama"))
