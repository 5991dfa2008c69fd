"""Download a model into the model cache, once: what the pods' ``fetch-model`` init container runs.

    python -m radixserve.common.model_fetch URI --cache DIR [--size-limit 100Gi] [--sha256 HEX]
                                            [--skip-weights]
    python -m radixserve.common.model_fetch --digest DIR      (print a folder's digest, to pin it)

(also ``radixserve fetch-model ...``). It prints the model folder, ``DIR/<entry>/<name>`` (see
model_source and model_cache), after one of:

* a hit: the entry is complete (and its digest is the pinned one): nothing is asked of the source;
* a download: under the entry's lock, so of several pods starting at once one downloads and the
  others wait and then hit; the folder must hold a config.json, digest to ``--sha256`` when given
  and fit ``--size-limit``, and the least recently used entries are evicted to make room.

``--skip-weights`` (s3:// and gs:// only): everything but the weights, and a manifest of the
``*.safetensors`` objects, which the scheduler streams at load (``--load-format stream``;
weight_manifest). Its own cache entry; no ``--sha256`` (the weights are never written to digest).

A failure exits 1 with one line naming the URI and what was missing, also written to
/dev/termination-log where that exists: Kubernetes puts it in the pod's status, and the operator's
status module reports it on the InferenceService.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from radixserve.common.model_cache import COMPILED, EntryRecord, ModelCache, folder_size
from radixserve.common.model_source import (
    DEFAULT_CACHE_SIZE,
    ModelSource,
    ModelSourceError,
    check_sha256,
    format_bytes,
    parse_model_uri,
    parse_quantity,
    tree_digest,
    tree_files,
)
from radixserve.common.model_stores import ObjectStore, RemoteFile, hub_download, open_store
from radixserve.common.weight_manifest import STREAMED_SUFFIX, StreamManifest, is_weight

TERMINATION_LOG = "/dev/termination-log"
DOWNLOAD_THREADS = 8  # objects in flight at once (boto3 also splits each large one into parts)
Log = Callable[[str], None]


def log_to_stderr(line: str) -> None:
    print(f"fetch-model: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class FetchResult:
    model_dir: Path
    downloaded: bool  # False: found complete in the cache
    record: EntryRecord


def fetch(source: ModelSource, cache: ModelCache, sha256: str = "", log: Log = log_to_stderr) -> FetchResult:
    """``source``'s model folder in ``cache``, downloaded unless a complete entry (with digest
    ``sha256``, when given) is there; ModelSourceError naming what is wrong otherwise."""
    if not source.downloads:
        raise ModelSourceError(
            f"{source.uri}: nothing to download (pvc:// and local models are used in place)"
        )
    if not source.weights and source.scheme not in ("s3", "gs"):
        raise ModelSourceError(
            f"{source.uri}: --skip-weights streams the weights from s3:// or gs:// only (an {source.scheme}"
            " model is fetched whole)"
        )
    if not source.weights and sha256:
        raise ModelSourceError(
            f"{source.uri}: --sha256 pins the whole folder, and --skip-weights never writes the weights"
        )
    with cache.lock(source.entry()):
        record = cache.record(source)
        if record is not None and (not sha256 or record.digest == sha256):
            cache.touch(source)
            log(f"{source.uri}: found in the cache (sha256 {record.digest})")
            return FetchResult(cache.model_dir(source), False, record)
        if record is not None:
            log(f"{source.uri}: the cached copy digests to {record.digest}, not {sha256}: downloading again")
        model_dir = cache.begin(source)
        try:
            record = _download(source, cache, model_dir, log)
            _check(source, model_dir, record, sha256, cache.size_limit)
        except BaseException:
            cache.discard(source)  # a partial or refused download is never served
            raise
        cache.finish(source, record)
        log(f"{source.uri}: {record.files} files, {format_bytes(record.size)}, sha256 {record.digest}")
        try:  # a Hub model's size is known only now; the model is complete either way
            cache.make_room(0, keep=source)
        except ModelSourceError as e:
            log(f"the cache stays over its size limit for now: {e}")
    return FetchResult(model_dir, True, record)


def _download(source: ModelSource, cache: ModelCache, model_dir: Path, log: Log) -> EntryRecord:
    started = time.monotonic()
    revision, etags = "", {}
    if source.scheme == "hf":
        log(f"{source.uri}: downloading from the Hub into {model_dir}")
        revision = hub_download(source, model_dir, staging=model_dir.parent / ".hub")
        if not source.pinned:  # a branch or tag: say what it named, and how to pin that
            log(
                f"{source.uri}: {source.revision!r} is {revision} now; pin it: hf://{source.location}@{revision}"
            )
    else:
        store = open_store(source)
        files = store.list()
        if not files:
            where = f"under the prefix {source.path}/" if source.path else "in the bucket"
            raise ModelSourceError(f"{source.uri}: no objects {where}")
        if not source.weights:
            files = _without_weights(source, files, model_dir, log)
        total = sum(f.size for f in files)
        cache.make_room(total, keep=source)
        log(f"{source.uri}: downloading {len(files)} objects ({format_bytes(total)}) into {model_dir}")
        _download_all(store, files, model_dir)
        etags = {f.rel: f.etag for f in files}
    log(f"{source.uri}: downloaded in {time.monotonic() - started:.1f} s")
    return EntryRecord(
        uri=source.uri,
        digest=tree_digest(model_dir),
        size=folder_size(model_dir),
        files=len(tree_files(model_dir)),
        revision=revision,
        etags=etags,
        fetched_at=time.time(),
    )


def _without_weights(
    source: ModelSource, files: list[RemoteFile], model_dir: Path, log: Log
) -> list[RemoteFile]:
    """``files`` less the weights; the ``*.safetensors`` among them listed in the folder's manifest."""
    streamed = tuple(f for f in files if f.rel.endswith(STREAMED_SUFFIX) and "/" not in f.rel)
    if not streamed:
        raise ModelSourceError(f"{source.uri}: no *.safetensors objects to stream (--skip-weights)")
    unused = [f for f in files if is_weight(f.rel) and f not in streamed]
    StreamManifest(source.uri, streamed).write(model_dir)
    log(
        f"{source.uri}: {len(streamed)} *.safetensors ({format_bytes(sum(f.size for f in streamed))}) left "
        "in the store, streamed at load"
        + (f"; {len(unused)} weights in formats not loaded left out" if unused else "")
    )
    return [f for f in files if not is_weight(f.rel)]


def _download_all(store: ObjectStore, files: list[RemoteFile], model_dir: Path) -> None:
    for f in files:
        (model_dir / f.rel).parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        # list() so the first failure raises here, after the others stop.
        list(pool.map(lambda f: store.download(f, model_dir / f.rel), files))


def _check(source: ModelSource, model_dir: Path, record: EntryRecord, sha256: str, limit: int) -> None:
    if not (model_dir / "config.json").is_file():
        names = tree_files(model_dir)
        found = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ModelSourceError(
            f"{source.uri}: no config.json in the downloaded files (a Hugging Face model folder is "
            f"needed; found {found or 'nothing'})"
        )
    if sha256 and record.digest != sha256:
        raise ModelSourceError(
            f"{source.uri}: sha256 mismatch: the files digest to {record.digest}, the pin is {sha256}"
        )
    if record.size > limit:
        raise ModelSourceError(
            f"{source.uri} is {format_bytes(record.size)}, more than the model cache's size limit "
            f"{format_bytes(limit)} (raise spec.model.cache.sizeLimit)"
        )


# ------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixserve fetch-model",
        description="Download a model (hf://, s3://, gs://) once into a bounded cache; print its folder.",
    )
    p.add_argument(
        "uri", nargs="?", help="hf://org/name[@revision], s3://bucket/prefix or gs://bucket/prefix"
    )
    p.add_argument("--cache", help="the cache folder (a shared volume: several fetchers may use it at once)")
    p.add_argument("--size-limit", default=DEFAULT_CACHE_SIZE, help="bytes the cache may hold (a quantity)")
    p.add_argument("--sha256", default="", help="the digest the downloaded folder must have (see --digest)")
    p.add_argument("--digest", metavar="DIR", help="print DIR's digest (what --sha256 pins) and exit")
    p.add_argument(
        "--skip-weights",
        action="store_true",
        help="s3:// and gs://: fetch all but the weights; the scheduler streams them (--load-format stream)",
    )
    p.add_argument("--termination-log", default=TERMINATION_LOG, help="where a failure's line also goes")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.digest:
        if not Path(args.digest).is_dir():
            parser.error(f"--digest {args.digest}: not a folder")
        print(tree_digest(Path(args.digest)))
        return 0
    if not args.uri or not args.cache:
        parser.error("a URI and --cache are needed (or --digest DIR)")
    try:
        source = parse_model_uri(args.uri)
        if args.skip_weights:
            source = dataclasses.replace(source, weights=False)
        sha256 = check_sha256(args.sha256) if args.sha256 else ""
        try:
            limit = parse_quantity(args.size_limit)
        except ValueError as e:
            raise ModelSourceError(f"--size-limit: {e}") from e
        result = fetch(source, ModelCache(Path(args.cache), limit, log_to_stderr), sha256)
        (Path(args.cache) / COMPILED).mkdir(exist_ok=True)  # the schedulers' compile cache (a subPath)
    except ModelSourceError as e:
        return _fail(str(e), args.termination_log)
    except Exception as e:  # unforeseen: the one line for the pod's status, the traceback for its log
        traceback.print_exc()
        return _fail(f"{args.uri}: {type(e).__name__}: {e}", args.termination_log)
    print(result.model_dir, flush=True)
    return 0


def _fail(message: str, termination_log: str) -> int:
    log_to_stderr(message)
    log = Path(termination_log)
    if log.exists() or termination_log != TERMINATION_LOG:  # the default exists only in a container
        try:
            log.write_text(message + "\n")
        except OSError as e:
            log_to_stderr(f"cannot write {log}: {e.strerror}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
