"""API keys at the front door: the keys a client must present (``--api-key``, ``--api-key-file``),
and the check of a presented one, in constant time, for both front ends.

HTTP: ``Authorization: Bearer KEY`` (what the OpenAI SDKs send) or ``x-api-key: KEY``; a refusal is a
401 with OpenAI's error body and ``WWW-Authenticate: Bearer``. gRPC Generate: metadata
``authorization: Bearer KEY``; a refusal is UNAUTHENTICATED. No key configured: no check.

Open without a key: ``GET /health`` (probes), ``/metrics`` unless ``--protect-metrics``, and on the
gRPC port the health service and the detokenizer's ``Deliver`` (pod to pod: a network policy's to
guard, not a client's key).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.common.service_config import GatewayConfig
from radixserve.tokenizer.errors import ApiError

MISSING = "no API key: send the header Authorization: Bearer YOUR_KEY"
MISSING_GRPC = "no API key: send the metadata authorization: Bearer YOUR_KEY"
WRONG = "incorrect API key"


class ApiKeys:
    """The accepted keys. Only their SHA-256 digests are kept: a presented key's digest is compared
    with every one of them (hmac.compare_digest, no early exit), so the time taken says nothing of
    how much of a key was right, nor which key, nor its length."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = tuple(_digest(k) for k in dict.fromkeys(keys))

    @classmethod
    def from_config(cls, config: GatewayConfig) -> ApiKeys:
        """``--api-key`` and the keys in ``--api-key-file``, read now. A file that cannot be read,
        holds no key, or a key that cannot be sent in a header: SystemExit with what is wrong
        (the key itself is never printed)."""
        keys = list(config.api_key)
        for i, k in enumerate(keys, 1):
            _check_key(k, f"--api-key: key {i} of {len(keys)}")
        if config.api_key_file is not None:
            keys += read_key_file(config.api_key_file)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, presented: str | None) -> bool:
        if presented is None:
            return False
        d = _digest(presented)
        ok = False
        for k in self._digests:  # every key, whatever matched: the time does not depend on which
            ok |= hmac.compare_digest(k, d)
        return ok

    def refusal(self, headers: Mapping[str, str], missing: str = MISSING) -> str | None:
        """Why a request with these headers (lower-case names: HTTP headers or gRPC metadata) may
        not pass (``missing`` if it presents no key); None if it may, or no key is configured."""
        if not self._digests:
            return None
        presented = presented_key(headers)
        if presented is None:
            return missing
        return None if self.accepts(presented) else WRONG


def read_key_file(path: str | Path) -> list[str]:
    """The keys in a file, one per line (e.g. a mounted Secret); blank lines and ``#`` comments are
    skipped, surrounding whitespace stripped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"--api-key-file {path}: cannot read it ({e.__class__.__name__}: {e})") from e
    keys = []
    for n, line in enumerate(lines, 1):
        k = line.strip()
        if k and not k.startswith("#"):
            _check_key(k, f"--api-key-file {path}: line {n}")
            keys.append(k)
    if not keys:
        raise SystemExit(f"--api-key-file {path}: no key in it (one per line; # starts a comment)")
    return keys


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: ``authorization: Bearer KEY`` (the scheme in any case), else
    ``x-api-key: KEY``; None if neither."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("x-api-key", "").strip()
    return key or None


def _check_key(key: str, where: str) -> None:
    if not key or not all("!" <= c <= "~" for c in key):
        raise SystemExit(f"{where}: a key must be non-empty printable ASCII without spaces")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class RequireApiKey:
    """ASGI middleware: a request to any path but ``open_paths`` without an accepted key is a 401
    before anything reads its body. ``refused(path)`` is told of each (to count it)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        open_paths: Collection[str],
        refused: Callable[[str], None] | None = None,
    ) -> None:
        self.app, self.keys, self.open_paths, self.refused = app, keys, frozenset(open_paths), refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        why = self.keys.refusal(headers)
        if why is None:
            await self.app(scope, receive, send)
            return
        if self.refused is not None:
            self.refused(scope["path"])
        response = JSONResponse(
            ApiError(401, why, code="invalid_api_key").body(),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)
