"""The remote stores a model is downloaded from: S3 (boto3), Google Cloud Storage (gcsfs) and the
Hugging Face Hub (huggingface_hub). Each client is imported when its scheme is used, so a missing
optional one (``pip install radixserve[s3]`` / ``[gcs]``) is a clear error, not an import failure.

Every failure a user can fix comes out as a ModelSourceError whose message names the URI and what
was missing: the bucket, objects under the prefix, the repository or revision, the credentials.

Credentials come from the environment, which the operator fills from ``spec.model.credentialsSecretRef``:
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN / AWS_REGION / AWS_ENDPOINT_URL (an
S3-compatible store: MinIO, Ceph, R2...), GOOGLE_APPLICATION_CREDENTIALS (a service-account key
file), HF_TOKEN; STORAGE_EMULATOR_HOST points gs:// at a GCS emulator (used anonymously: the tests'
gcp-storage-emulator).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from radixserve.common.model_source import ModelSource, ModelSourceError

STREAM_CHUNK = 1 << 20  # a ranged read's body is handed on in pieces of this size


class StoreReadError(ModelSourceError):
    """The store could not be reached or a connection broke mid-answer: worth another try."""


@dataclass(frozen=True, slots=True)
class RemoteFile:
    key: str  # the object's full name in the bucket
    rel: str  # its path under the prefix: where it lands in the model folder
    size: int
    etag: str  # what identifies this content: S3's ETag, GCS's generation (a stream checks it)


class ObjectStore(Protocol):
    """A bucket-like store: list the objects under the source's prefix, download one, or read bytes
    ``start:stop`` of one (the streaming loader: scheduler/model/weight_stream.py), in chunks as they
    arrive. A read of an object whose size is no longer ``file.size`` may raise ModelSourceError
    (S3 does, from the answer's Content-Range); a short read is the caller's to notice."""

    def list(self) -> list[RemoteFile]: ...

    def download(self, file: RemoteFile, dest: Path) -> None: ...

    def read(self, file: RemoteFile, start: int, stop: int) -> Iterator[bytes]: ...


def open_store(source: ModelSource) -> ObjectStore:
    if source.scheme == "s3":
        return S3Store(source)
    if source.scheme == "gs":
        return GcsStore(source)
    raise ModelSourceError(f"{source.uri}: not an object store")


def _changed(source: ModelSource, file: RemoteFile, size: object, tag: str, now: str) -> ModelSourceError:
    """An object replaced since the fetch listed it: what it is now (``tag``: the store's name for
    its version, S3's ETag or GCS's generation) against the listing."""
    return ModelSourceError(
        f"{source.uri}/{file.rel} changed since the model was fetched: {size} bytes, {tag} {now}; the "
        f"listing said {file.size} bytes, {tag} {file.etag} (fetch the model again)"
    )


def _prefix(source: ModelSource) -> str:
    """The key prefix, ending in "/" so that ``models/a`` does not take ``models/ab``'s objects."""
    return f"{source.path}/" if source.path else ""


def _under(source: ModelSource, key: str) -> str | None:
    """``key`` relative to the prefix; None for folder placeholders and anything that would escape."""
    rel = key[len(_prefix(source)) :]
    parts = rel.split("/")
    if not rel or rel.endswith("/") or any(p in ("", ".", "..") for p in parts):
        return None
    return rel


# ------------------------------------------------------------------------------------------ S3
class S3Store:
    def __init__(self, source: ModelSource) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:
            raise ModelSourceError(f"{source.uri}: s3:// needs boto3 (pip install 'radixserve[s3]')") from e
        self.source = source
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        # S3-compatible stores rarely serve virtual-hosted bucket names: path style with an endpoint.
        config = Config(
            connect_timeout=10,
            retries={"max_attempts": 4, "mode": "standard"},
            s3={"addressing_style": "path"} if self.endpoint else {},
        )
        self.client: Any = boto3.client("s3", endpoint_url=self.endpoint, region_name=region, config=config)

    def list(self) -> list[RemoteFile]:
        out: list[RemoteFile] = []
        with self._errors():
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.source.location, Prefix=_prefix(self.source)
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = _under(self.source, str(obj["Key"]))
                    if rel is not None:
                        out.append(
                            RemoteFile(str(obj["Key"]), rel, int(obj["Size"]), str(obj.get("ETag", "")))
                        )
        return out

    def download(self, file: RemoteFile, dest: Path) -> None:
        with self._errors(file.key):
            self.client.download_file(self.source.location, file.key, str(dest))

    def read(self, file: RemoteFile, start: int, stop: int) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        # If-Match: every range comes from the object the listing saw (a model replaced under the same
        # key since the fetch would otherwise load half of each version).
        match = {"IfMatch": file.etag} if file.etag else {}
        with self._errors(file.key):
            try:
                answer = self.client.get_object(
                    Bucket=self.source.location, Key=file.key, Range=f"bytes={start}-{stop - 1}", **match
                )
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code", "")) not in ("PreconditionFailed", "412"):
                    raise
                now = self.client.head_object(Bucket=self.source.location, Key=file.key)
                raise _changed(self.source, file, now["ContentLength"], "ETag", now.get("ETag", "")) from e
            total = str(answer.get("ContentRange", "")).rpartition("/")[2]
            if total.isdigit() and int(total) != file.size:
                raise ModelSourceError(
                    f"{self.source.uri}/{file.rel}: the object is {total} bytes, the listing said "
                    f"{file.size} bytes (changed or truncated since the model was fetched)"
                )
            yield from answer["Body"].iter_chunks(STREAM_CHUNK)

    @contextlib.contextmanager
    def _errors(self, key: str = "") -> Iterator[None]:
        """``key``: the object read, named in a missing object's message."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
        )

        uri, bucket = self.source.uri, self.source.location
        try:
            yield
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                raise ModelSourceError(f"{uri}: bucket {bucket!r} does not exist") from e
            if code in ("NoSuchKey", "404"):
                raise ModelSourceError(f"{uri}: no object {key!r} in bucket {bucket!r}") from e
            if code == "InvalidRange":
                raise ModelSourceError(
                    f"{uri}: object {key!r} is shorter than the listing said (truncated since the "
                    "model was fetched)"
                ) from e
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
                raise ModelSourceError(
                    f"{uri}: access denied ({code}): check the credentials Secret's AWS_ACCESS_KEY_ID "
                    "and AWS_SECRET_ACCESS_KEY"
                ) from e
            raise ModelSourceError(f"{uri}: S3 answered {code}: {e}") from e
        except NoCredentialsError as e:
            raise ModelSourceError(
                f"{uri}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, in the pods "
                "through spec.model.credentialsSecretRef)"
            ) from e
        except EndpointConnectionError as e:
            raise StoreReadError(
                f"{uri}: cannot reach the S3 endpoint {self.endpoint or 'of AWS'}: {e}"
            ) from e
        except BotoCoreError as e:  # also a connection lost while a body streams
            raise StoreReadError(f"s3://{bucket}/{key}: {e}" if key else f"{uri}: {e}") from e


# ----------------------------------------------------------------------------------------- GCS
class GcsStore:
    """Through gcsfs (fsspec). An object's generation is its ``etag``: before an object's first ranged
    read its metadata is asked for (a size or generation other than the listing's is a
    ModelSourceError naming both), and every ranged read asks for the listed generation (GCS answers
    404 once it is replaced or deleted: the metadata then tells which); a read that ends early is
    checked the same way. The tests run it against gcp-storage-emulator (tests/helpers/gcs.py),
    which serves the live generation whatever is asked: they exercise the metadata checks.

    ``STORAGE_EMULATOR_HOST`` (an emulator's address; gcsfs then talks to it) means anonymous access,
    as Google's own libraries take it, through gcsfs's core class: the default one first asks for the
    bucket's layout over gRPC, which an emulator does not serve (a minute's timeout for each call)."""

    def __init__(self, source: ModelSource) -> None:
        try:
            import gcsfs
        except ImportError as e:
            raise ModelSourceError(f"{source.uri}: gs:// needs gcsfs (pip install 'radixserve[gcs]')") from e
        self.source = source
        self._checked: set[str] = set()  # keys whose metadata matched the listing
        self._lock = threading.Lock()
        # No cached instance or listing: a listing is what the bucket holds now.
        options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            self.fs: Any = gcsfs.core.GCSFileSystem(token="anon", **options)
            return
        key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        if key_file and not Path(key_file).is_file():
            raise ModelSourceError(
                f"{source.uri}: GOOGLE_APPLICATION_CREDENTIALS names {key_file}, which does not exist "
                "(the credentials Secret needs the key service-account.json)"
            )
        # Without a key file gcsfs finds the node's or workload identity's credentials.
        self.fs = gcsfs.GCSFileSystem(token=key_file or None, **options)

    def list(self) -> list[RemoteFile]:
        bucket = self.source.location
        with self._errors():
            try:
                found = self.fs.find(f"{bucket}/{self.source.path}".rstrip("/"), detail=True)
            except FileNotFoundError:  # the bucket's listing answered 404
                found = {}
            if not found:
                try:
                    self.fs.call("GET", "b/{}", bucket, json_out=True)  # 404 for a missing bucket
                except OSError as e:  # a key that may read objects but not the bucket's metadata
                    if not str(e).startswith("Forbidden"):  # (storage.buckets.get): the prefix is empty
                        raise
        out = []
        for full, info in sorted(found.items()):
            key = str(full).split("/", 1)[1] if "/" in str(full) else ""
            rel = _under(self.source, key)
            if rel is not None and info.get("type") == "file":
                generation = str(info.get("generation") or "")
                out.append(RemoteFile(key, rel, int(info.get("size") or 0), generation))
        return out

    def download(self, file: RemoteFile, dest: Path) -> None:
        with self._errors(file.key):
            self.fs.get_file(f"{self.source.location}/{file.key}", str(dest))

    def read(self, file: RemoteFile, start: int, stop: int) -> Iterator[bytes]:
        # One ranged GET of the listed generation (the whole part in one answer), through cat_file:
        # gcsfs's default class reads a zonal (Rapid) bucket's objects over gRPC there.
        with self._errors(file.key):
            if file.key not in self._checked:
                self._check(file)
            pin = {"generation": file.etag} if file.etag.isdigit() else {}
            try:
                body = self.fs.cat_file(f"{self.source.location}/{file.key}", start=start, end=stop, **pin)
            except FileNotFoundError:  # the listed generation is gone: replaced, or deleted
                self._check(file)
                raise
            if len(body) < stop - start:  # the object ends early: say what it is now
                self._check(file)
        yield bytes(body)

    def _check(self, file: RemoteFile) -> None:
        """The object's metadata now against the listing's size and generation."""
        meta = self.fs.call("GET", "b/{}/o/{}", self.source.location, file.key, json_out=True)
        size, generation = str(meta.get("size", "")), str(meta.get("generation", ""))
        if size != str(file.size) or (file.etag and generation != file.etag):
            raise _changed(self.source, file, size, "generation", generation)
        with self._lock:
            self._checked.add(file.key)

    @contextlib.contextmanager
    def _errors(self, key: str = "") -> Iterator[None]:
        """gcsfs's errors as ours; ``key``: the object read, named when it is missing."""
        from gcsfs.retry import HttpError

        uri, bucket = self.source.uri, self.source.location
        denied = f"{uri}: access denied: check the service-account key (GOOGLE_APPLICATION_CREDENTIALS)"
        try:
            yield
        except FileNotFoundError as e:  # gcsfs's 404: of the bucket's listing, or of the object
            if not key:
                raise ModelSourceError(f"{uri}: bucket {bucket!r} does not exist") from e
            raise ModelSourceError(f"{uri}: no object {key!r} in bucket {bucket!r}") from e
        except PermissionError as e:
            raise ModelSourceError(denied) from e
        except HttpError as e:  # 401, or what is left after gcsfs's own retries (5xx, 429)
            if e.code in (401, 403):
                raise ModelSourceError(denied) from e
            raise StoreReadError(f"{uri}: GCS answered {e.code}: {e.message}") from e
        except OSError as e:  # gcsfs's 403 ("Forbidden: ..."), a connection that failed or broke
            if str(e).startswith("Forbidden"):
                raise ModelSourceError(denied) from e
            raise StoreReadError(f"gs://{bucket}/{key}: {e}" if key else f"{uri}: {e}") from e


# ----------------------------------------------------------------------------------------- Hub
def hub_download(source: ModelSource, dest: Path, staging: Path) -> str:
    """Download ``source`` (hf://) into ``dest`` (empty); returns the commit its revision resolved to.

    With HF_HUB_CACHE or HF_HOME set, the hub's own cache there is used (and may already hold the
    revision: with HF_HUB_OFFLINE=1 nothing is asked of the Hub) and the files are copied out of it;
    otherwise the hub downloads into ``staging`` (on the cache's volume, so its size limit holds)
    and the files are moved."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    own_cache = not (os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME"))
    uri, repo = source.uri, source.location
    try:
        snapshot = snapshot_download(
            repo, revision=source.revision, cache_dir=str(staging) if own_cache else None
        )
    except GatedRepoError as e:
        raise ModelSourceError(
            f"{uri}: {repo} is gated: accept its terms on the Hub and give an HF_TOKEN"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelSourceError(
            f"{uri}: repository {repo} not found on the Hub (a private one needs an HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelSourceError(f"{uri}: revision {source.revision!r} not found in {repo}") from e
    except LocalEntryNotFoundError as e:
        raise ModelSourceError(
            f"{uri}: not in the local Hub cache and the Hub cannot be reached (or HF_HUB_OFFLINE is set)"
        ) from e
    except HfHubHTTPError as e:
        raise ModelSourceError(f"{uri}: the Hub answered: {e}") from e
    _materialize(Path(snapshot), dest, move=own_cache)
    if own_cache:
        shutil.rmtree(staging, ignore_errors=True)
    return Path(snapshot).name  # snapshots/<commit>


def _materialize(snapshot: Path, dest: Path, move: bool) -> None:
    """Real files in ``dest`` for the snapshot's links into the hub's blobs (moved out of a cache we
    own, copied out of one we do not; a blob two files share is moved once and then copied)."""
    placed: dict[Path, Path] = {}
    for dirpath, _, names in os.walk(snapshot, followlinks=True):
        for name in names:
            src = Path(dirpath) / name
            target = dest / src.relative_to(snapshot)
            target.parent.mkdir(parents=True, exist_ok=True)
            blob = src.resolve()
            if blob in placed:
                shutil.copyfile(placed[blob], target)
            elif move:
                os.replace(blob, target)
                placed[blob] = target
            else:
                shutil.copyfile(blob, target)
