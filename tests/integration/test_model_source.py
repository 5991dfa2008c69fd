"""Model sources and the model cache against real parts: a moto S3 server (server mode, a child process
on a free loopback port) holding a tiny random-weight model, fetched by the real command
(``python -m radixserve.common.model_fetch``) and loaded with transformers; a Hugging Face hub cache
folder on disk, read offline; concurrent fetchers as separate processes. gs:// against a GCS
emulator: test_model_source_gcs.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from radixserve.common.demo_model import make_demo_model
from radixserve.common.model_cache import MARKER, ModelCache
from radixserve.common.model_fetch import fetch
from radixserve.common.model_source import (
    ModelSource,
    ModelSourceError,
    parse_model_uri,
    parse_quantity,
    tree_digest,
    tree_files,
)
from radixserve.common.model_stores import _materialize
from radixserve.common.ports import free_port
from tests.helpers.s3 import BUCKET, s3_client, s3_endpoint_fixture, s3_env_fixture, upload  # noqa: F401

boto3 = pytest.importorskip("boto3", reason="pip install -e '.[test]' (boto3, moto[server])")


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", arch="llama", size="tiny")


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str, model_dir: Path) -> Any:
    """The bucket, with the tiny model under llama/, llama-copy/ and llama-third/ and a folder
    without a config.json under no-config/."""
    client = s3_client(s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    for prefix in ("llama", "llama-copy", "llama-third"):
        upload(client, model_dir, prefix)
    client.put_object(Bucket=BUCKET, Key="no-config/model.safetensors", Body=b"weights")
    return client


def _fetch_cli(*args: str, env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "radixserve.common.model_fetch", *args]
    return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120, **kw)


def _mtimes(folder: Path) -> dict[str, int]:
    return {rel: (folder / rel).stat().st_mtime_ns for rel in tree_files(folder)}


# ---------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("uri", "canonical", "name"),
    [
        ("hf://Qwen/Qwen3-0.6B", "hf://Qwen/Qwen3-0.6B@main", "Qwen3-0.6B"),
        ("hf://org/m@0123456789abcdef0123456789abcdef01234567", None, "m"),
        ("s3://models/team/llama-8b/", "s3://models/team/llama-8b", "llama-8b"),
        ("gs://my_bucket/llama", "gs://my_bucket/llama", "llama"),
        ("pvc://weights/llama-8b", "pvc://weights/llama-8b", "llama-8b"),
        ("file:///opt/models/llama/", "/opt/models/llama", "llama"),
    ],
)
def test_model_uris_parse_to_one_canonical_spelling(uri: str, canonical: str | None, name: str) -> None:
    source = parse_model_uri(uri)
    assert source.uri == (canonical or uri) and source.name == name
    assert parse_model_uri(source.uri) == source  # the canonical form parses back to itself
    assert source.pinned == (uri.startswith("hf://") and "@0123" in uri)


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("hf://llama", "hf://org/name[@revision]"),
        ("hf://org/m@", "is not a revision"),
        ("s3:///prefix", "the bucket is missing"),
        ("s3://Bad_Bucket/x", "not a valid bucket name"),
        ("ftp://host/x", "unknown scheme 'ftp'"),
        ("models/llama", "nor an absolute local path"),
        ("pvc://Claim/x", "not a PersistentVolumeClaim name"),
    ],
)
def test_malformed_uris_are_refused_saying_why(uri: str, words: str) -> None:
    with pytest.raises(ModelSourceError) as err:
        parse_model_uri(uri)
    assert words in str(err.value) and str(err.value).startswith(uri)


def test_quantities_read_as_kubernetes_writes_them() -> None:
    assert parse_quantity("100Gi") == 100 * 2**30 and parse_quantity("1.5G") == 1_500_000_000
    assert parse_quantity("1e3") == 1000 and parse_quantity("2048") == 2048
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity("10 GB")


def test_the_digest_is_the_documented_sha256sum_pipeline(model_dir: Path) -> None:
    # The module docstring's shell command, run as a user would.
    shell = "find . -type f -printf '%P\\0' | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum"
    out = subprocess.run(["bash", "-c", shell], cwd=model_dir, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == tree_digest(model_dir)
    cli = _fetch_cli("--digest", str(model_dir), env={})
    assert cli.returncode == 0 and cli.stdout.strip() == tree_digest(model_dir)


# ---------------------------------------------------------------------------------------- S3
def test_s3_model_is_fetched_once_and_loads_with_transformers(
    bucket: Any, s3_env: dict[str, str], model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoConfig, AutoTokenizer

    cache = tmp_path / "cache"
    first = _fetch_cli(f"s3://{BUCKET}/llama", "--cache", str(cache), env=s3_env)
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip().splitlines()[-1])
    # Where the operator mounts it from (volumes.model_volumes' subPath), and byte for byte the upload.
    assert folder == cache / parse_model_uri(f"s3://{BUCKET}/llama").relative_model_dir()
    assert folder.name == "llama" and tree_digest(folder) == tree_digest(model_dir)
    assert AutoConfig.from_pretrained(folder).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer("def main():").input_ids) == "def main():"
    assert "downloading" in first.stderr

    # Again, with the S3 endpoint dead: a complete entry is used without asking the store.
    before = _mtimes(folder)
    dead = {**s3_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    second = _fetch_cli(f"s3://{BUCKET}/llama", "--cache", str(cache), env=dead)
    assert second.returncode == 0, second.stderr
    assert Path(second.stdout.strip()) == folder and "found in the cache" in second.stderr
    assert _mtimes(folder) == before


def test_a_pinned_digest_is_checked_and_a_mismatch_refused(
    bucket: Any, s3_env: dict[str, str], model_dir: Path, tmp_path: Path
) -> None:
    source = parse_model_uri(f"s3://{BUCKET}/llama")
    cache = ModelCache(tmp_path, parse_quantity("1Gi"))
    good = tree_digest(model_dir)
    assert fetch(source, cache, good).record.digest == good
    assert fetch(source, cache, good).downloaded is False  # the pin matches the cached copy: a hit
    # A pin the cached copy does not match is downloaded again, and refused when the source differs.
    wrong = "0" * 64
    with pytest.raises(ModelSourceError) as err:
        fetch(source, cache, wrong)
    assert str(err.value) == (
        f"s3://{BUCKET}/llama: sha256 mismatch: the files digest to {good}, the pin is {wrong}"
    )
    assert not (tmp_path / source.entry()).exists()  # nothing half-trusted is left to be served


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://no-such-bucket/llama", "s3://no-such-bucket/llama: bucket 'no-such-bucket' does not exist"),
        (f"s3://{BUCKET}/absent", f"s3://{BUCKET}/absent: no objects under the prefix absent/"),
        (f"s3://{BUCKET}/llam", f"s3://{BUCKET}/llam: no objects under the prefix llam/"),  # not llama/
        (
            f"s3://{BUCKET}/no-config",
            f"s3://{BUCKET}/no-config: no config.json in the downloaded files (a Hugging Face model folder "
            "is needed; found model.safetensors)",
        ),
    ],
)
def test_a_missing_source_fails_with_one_line_in_the_termination_log(
    bucket: Any, s3_env: dict[str, str], tmp_path: Path, uri: str, message: str
) -> None:
    log = tmp_path / "termination-log"
    out = _fetch_cli(uri, "--cache", str(tmp_path / "cache"), "--termination-log", str(log), env=s3_env)
    assert out.returncode == 1 and out.stdout == ""
    assert log.read_text() == message + "\n"  # what Kubernetes shows in the pod's status
    assert out.stderr.strip().splitlines()[-1] == f"fetch-model: {message}"
    assert list((tmp_path / "cache").iterdir()) == [tmp_path / "cache" / ".locks"]  # no entry left


def test_an_unreachable_store_is_named(bucket: Any, s3_env: dict[str, str], tmp_path: Path) -> None:
    env = {**s3_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    out = _fetch_cli(f"s3://{BUCKET}/llama", "--cache", str(tmp_path), env=env)
    assert out.returncode == 1
    assert f"s3://{BUCKET}/llama: cannot reach the S3 endpoint http://127.0.0.1:" in out.stderr


def test_least_recently_used_entries_are_evicted_to_fit_the_size_limit(
    bucket: Any, s3_env: dict[str, str], model_dir: Path, tmp_path: Path
) -> None:
    size = sum((model_dir / rel).stat().st_size for rel in tree_files(model_dir))
    cache = ModelCache(tmp_path, size * 5 // 2)  # room for two copies, not three
    a, b, c = (parse_model_uri(f"s3://{BUCKET}/{p}") for p in ("llama", "llama-copy", "llama-third"))
    fetch(a, cache)
    fetch(b, cache)
    os.utime(tmp_path / a.entry() / MARKER, (time.time() - 60, time.time() - 60))  # a: older
    os.utime(tmp_path / b.entry() / MARKER, (time.time() - 30, time.time() - 30))
    assert fetch(a, cache).downloaded is False  # a used now: b is the least recently used
    fetch(c, cache)
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {a.entry(), c.entry()}
    assert cache.usage() == 2 * size <= cache.size_limit
    # A model larger than the whole cache is refused before anything is downloaded.
    with pytest.raises(ModelSourceError, match=r"more than the model cache's size limit"):
        fetch(b, ModelCache(tmp_path / "small", size // 2))
    assert not (tmp_path / "small" / b.entry()).exists()


def test_concurrent_fetchers_download_once(bucket: Any, s3_env: dict[str, str], tmp_path: Path) -> None:
    source = parse_model_uri(f"s3://{BUCKET}/llama")
    cache = ModelCache(tmp_path / "cache", parse_quantity("1Gi"))
    logs = [tmp_path / f"fetcher{i}.err" for i in range(2)]
    cmd = [sys.executable, "-m", "radixserve.common.model_fetch", source.uri, "--cache", str(cache.root)]
    with cache.lock(source.entry()):  # both start while the entry is locked, and must wait for it
        procs = []
        for log in logs:
            with open(log, "w") as err:
                procs.append(
                    subprocess.Popen(
                        cmd, env={**os.environ, **s3_env}, stdout=subprocess.PIPE, stderr=err, text=True
                    )
                )
        deadline = time.monotonic() + 60
        while not all("waiting for another fetcher" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.05)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert {o.strip() for o in outs} == {str(cache.model_dir(source))}
    errs = [log.read_text() for log in logs]
    assert sorted("downloading" in e for e in errs) == [False, True]  # one downloads, once
    assert sorted("found in the cache" in e for e in errs) == [False, True]  # the other waits, then hits


# ------------------------------------------------------------------------------- hub, offline
def _hub_cache(root: Path, repo: str, commit: str, model: Path) -> Path:
    """A Hugging Face hub cache as huggingface_hub lays it out: blobs, a snapshot of links to them,
    refs/main naming the commit."""
    storage = root / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for rel in tree_files(model):
        blob = storage / "blobs" / _sha256_file(model / rel)
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model / rel, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return root


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_hf_uris_resolve_offline_from_a_local_hub_cache(model_dir: Path, tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    hub = _hub_cache(tmp_path / "hub", "radixserve/tiny-llama", commit, model_dir)
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    cache = tmp_path / "cache"
    pinned = _fetch_cli(f"hf://radixserve/tiny-llama@{commit}", "--cache", str(cache), env=env)
    assert pinned.returncode == 0, pinned.stderr
    folder = Path(pinned.stdout.strip())
    assert folder.name == "tiny-llama" and tree_digest(folder) == tree_digest(model_dir)
    assert not any(p.is_symlink() for p in folder.rglob("*"))  # real files, not links into the hub cache
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(folder).model_type == "llama"
    # A branch resolves through refs/ (and is recorded as the commit it named).
    branch = _fetch_cli("hf://radixserve/tiny-llama", "--cache", str(cache), env=env)
    assert branch.returncode == 0, branch.stderr
    assert f"pin it: hf://radixserve/tiny-llama@{commit}" in branch.stderr
    record = (Path(branch.stdout.strip()).parent / MARKER).read_text()
    assert f'"revision": "{commit}"' in record
    # A revision the local cache lacks, with the Hub out of reach: one clear line.
    missing = _fetch_cli("hf://radixserve/tiny-llama@v2", "--cache", str(cache), env=env)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1] == (
        "fetch-model: hf://radixserve/tiny-llama@v2: not in the local Hub cache and the Hub cannot be "
        "reached (or HF_HUB_OFFLINE is set)"
    )


def test_a_hub_download_we_staged_is_moved_out_of_its_blobs(model_dir: Path, tmp_path: Path) -> None:
    commit = "f" * 40
    hub = _hub_cache(tmp_path / "hub", "org/m", commit, model_dir)
    snapshot = hub / "models--org--m" / "snapshots" / commit
    dest = tmp_path / "dest"
    _materialize(snapshot, dest, move=True)
    assert tree_digest(dest) == tree_digest(model_dir)
    assert not any((hub / "models--org--m" / "blobs").iterdir())  # moved, not copied: no second copy


def test_sources_used_in_place_are_not_fetched(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path, 1 << 30)
    for uri in ("pvc://weights/llama", "/opt/models/llama"):
        with pytest.raises(ModelSourceError, match="nothing to download"):
            fetch(parse_model_uri(uri), cache)
    assert isinstance(parse_model_uri("pvc://weights"), ModelSource)
