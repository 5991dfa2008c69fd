"""Where a model comes from: ``spec.model.uri`` parsed into a :class:`ModelSource`, and the two
numbers a source is checked against, a cache size (a Kubernetes quantity) and a tree digest.

Pure and import-light: the operator validates URIs with it, the fetcher (``model_fetch``) downloads
with it, and both derive the same cache folder from it (:meth:`ModelSource.entry`).

    hf://org/name[@revision]   a Hugging Face Hub repository; a commit sha pins it, a branch or tag
                               is resolved once per cache entry (not a pin)
    s3://bucket[/prefix]       the objects under ``prefix/`` (boto3; S3-compatible stores through
                               AWS_ENDPOINT_URL)
    gs://bucket[/prefix]       the same on Google Cloud Storage (gcsfs)
    pvc://claim[/path]         a folder on a PersistentVolumeClaim, mounted read-only: no download
    /abs/path, file:///abs     a folder already in the pod (the image, or a volume the user mounts)

The tree digest (``sha256`` in the spec) is the SHA-256 of the ``sha256sum`` listing of the folder:
one line ``<sha256 of the file, hex>  <path relative to the folder>\\n`` per regular file, sorted by
path (bytewise, UTF-8). So ``python -m radixserve.common.model_fetch --digest DIR`` and

    cd DIR && find . -type f -printf '%P\\0' | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum

print the same hex (for paths without a newline or backslash, which ``sha256sum`` would escape).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Scheme = Literal["hf", "s3", "gs", "pvc", "local"]
DOWNLOADED: tuple[Scheme, ...] = ("hf", "s3", "gs")  # fetched into a cache by an init container
DEFAULT_HF_REVISION = "main"
DEFAULT_CACHE_SIZE = "100Gi"  # a pod's own model volume, when spec.model.cache gives no sizeLimit

# S3 bucket names: 3-63 lowercase letters, digits, dots and hyphens; GCS also allows underscores and,
# with dots, up to 222 characters. Loose on purpose: the store has the last word.
_BUCKET = {
    "s3": re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"),
    "gs": re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]"),
}
_HF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # an owner or a repository name
_REVISION = re.compile(r"[A-Za-z0-9._/-]+")
_CLAIM = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")  # a Kubernetes object name
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


class ModelSourceError(ValueError):
    """A model URI that cannot be used, or a source that does not hold a model; the message is one
    line naming the URI and what is wrong."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A parsed model URI. ``location``: the bucket, the Hub repository id (org/name) or the claim;
    empty for a local path. ``path``: the prefix in the bucket, the folder in the claim or the local
    folder, without leading or trailing slashes for the remote kinds. ``revision``: hf only.
    ``weights``: False for a fetch without the ``*.safetensors`` (s3/gs, streamed at load: see
    weight_manifest), which is a cache entry of its own."""

    scheme: Scheme
    location: str
    path: str = ""
    revision: str = ""
    weights: bool = True

    @property
    def uri(self) -> str:
        """The canonical URI: the same source always spells the same (it keys the cache)."""
        if self.scheme == "local":
            return self.path
        base = f"{self.scheme}://{self.location}" + (f"/{self.path}" if self.path else "")
        return f"{base}@{self.revision}" if self.scheme == "hf" else base

    @property
    def downloads(self) -> bool:
        return self.scheme in DOWNLOADED

    @property
    def name(self) -> str:
        """The model folder's name (the served model name when the spec gives none): the last part
        of the repository, prefix, claim folder or path."""
        tail = (self.path or self.location).rstrip("/").rsplit("/", 1)[-1]
        if self.scheme == "hf":
            tail = self.location.rsplit("/", 1)[-1]
        return tail or "model"

    @property
    def pinned(self) -> bool:
        """Whether the URI alone names fixed content (an hf commit sha); otherwise only ``sha256`` pins it."""
        return self.scheme == "hf" and re.fullmatch(r"[0-9a-f]{40}", self.revision) is not None

    def entry(self) -> str:
        """The cache entry's folder name for this source: 16 hex of the canonical URI's SHA-256. The
        model itself lies in ``<cache>/<entry>/<name>`` (see model_cache). A fetch without the
        weights has its own entry: a full fetch never finds it complete, nor it a full one."""
        key = self.uri if self.weights else f"{self.uri} without weights"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def relative_model_dir(self) -> str:
        """Where a download of this source lands, relative to the cache root."""
        return f"{self.entry()}/{self.name}"


def parse_model_uri(uri: str) -> ModelSource:
    """``uri`` as a :class:`ModelSource`; :class:`ModelSourceError` saying what is wrong otherwise."""
    text = uri.strip()
    if not text:
        raise ModelSourceError("the model URI is empty")
    if text.startswith("file://"):
        text = text[len("file://") :]
        if not text.startswith("/"):
            raise ModelSourceError(f"{uri}: a file:// URI needs an absolute path (file:///models/x)")
    if "://" not in text:
        if not text.startswith("/"):
            raise ModelSourceError(
                f"{uri}: not a known model URI (hf://org/name[@revision], s3://bucket/prefix, "
                "gs://bucket/prefix, pvc://claim/path) nor an absolute local path"
            )
        return ModelSource("local", "", os.path.normpath(text))
    scheme, rest = text.split("://", 1)
    if scheme == "hf":
        return _parse_hf(uri, rest)
    if scheme in ("s3", "gs", "pvc"):
        location, _, path = rest.partition("/")
        path = path.strip("/")
        if scheme == "pvc":
            if not _CLAIM.fullmatch(location):
                raise ModelSourceError(f"{uri}: {location!r} is not a PersistentVolumeClaim name")
            if ".." in path.split("/"):
                raise ModelSourceError(f"{uri}: the path in the claim may not contain '..'")
            return ModelSource("pvc", location, path)
        if not location:
            raise ModelSourceError(f"{uri}: the bucket is missing ({scheme}://bucket/prefix)")
        if not _BUCKET[scheme].fullmatch(location):
            raise ModelSourceError(f"{uri}: {location!r} is not a valid bucket name")
        return ModelSource("s3" if scheme == "s3" else "gs", location, path)
    raise ModelSourceError(f"{uri}: unknown scheme {scheme!r} (hf, s3, gs, pvc or a local path)")


def _parse_hf(uri: str, rest: str) -> ModelSource:
    repo, _, revision = rest.partition("@")
    parts = repo.strip("/").split("/")
    if len(parts) != 2 or not all(_HF_PART.fullmatch(p) for p in parts):
        raise ModelSourceError(f"{uri}: a Hub model is hf://org/name[@revision]")
    if "@" in rest and not _REVISION.fullmatch(revision):
        raise ModelSourceError(f"{uri}: {revision!r} is not a revision (a commit sha, branch or tag)")
    return ModelSource("hf", "/".join(parts), "", revision or DEFAULT_HF_REVISION)


def check_sha256(text: str) -> str:
    """``text`` as a lower-case 64-hex digest; ModelSourceError otherwise."""
    digest = text.strip().lower()
    if not _SHA256.fullmatch(digest):
        raise ModelSourceError(f"{text!r} is not a SHA-256 digest (64 hexadecimal characters)")
    return digest


# ------------------------------------------------------------------------------------- sizes
_SUFFIX = {
    **{s: 1024**i for i, s in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000**i for i, s in enumerate(("k", "M", "G", "T", "P", "E"), start=1)},
}
_QUANTITY = re.compile(
    r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E))?"
)


def parse_quantity(text: str) -> int:
    """A Kubernetes quantity of bytes (``100Gi``, ``500G``, ``1e9``, ``1048576``) as an int; ValueError
    saying so otherwise. Fractions round up (a limit is never read smaller than written)."""
    match = _QUANTITY.fullmatch(str(text).strip())
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 100Gi, 500G)")
    number, exponent, suffix = match.groups()
    value = float(number + (exponent or "")) * _SUFFIX[suffix or ""]
    return int(-(-value // 1))


def format_bytes(size: int) -> str:
    """``size`` for a message: ``12.3 GiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------ digest
def tree_files(root: Path) -> list[str]:
    """The regular files under ``root`` as sorted relative POSIX paths (what the digest covers)."""
    out = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    return sorted(out, key=lambda rel: rel.encode())


def tree_digest(root: Path) -> str:
    """The SHA-256 of ``root``'s sha256sum listing (see the module's docstring)."""
    listing = hashlib.sha256()
    for rel in tree_files(root):
        listing.update(f"{_file_sha256(root / rel)}  {rel}\n".encode())
    return listing.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
