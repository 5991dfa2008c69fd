"""The chained block hash of token sequences: the one key the prefix index, the gateway's router
and the scheduler's KV events all use.

    h_0 = xxh3_64(b"radixserve/v1:" + model name)            (the root: two models never collide)
    h_i = xxh3_64(h_{i-1} as 8 little-endian bytes || block i's token ids as little-endian u32)

Only full blocks of ``block_size`` tokens are hashed. A block's hash names the whole prefix up to
its end, so "pod P holds block hash h" means P caches that entire prefix. Deterministic across
processes and machines (never Python's ``hash()``, which is salted per process).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

DEFAULT_BLOCK_SIZE = 16
_U64 = (1 << 64) - 1


def root_hash(model_name: str) -> int:
    return xxhash.xxh3_64_intdigest(b"radixserve/v1:" + model_name.encode())


def chain(parent: int, tokens: Sequence[int] | npt.NDArray[np.integer], block_size: int) -> list[int]:
    """Hashes of the full blocks of ``tokens``, chained from ``parent`` (a trailing partial block is
    ignored)."""
    arr = np.asarray(tokens, dtype="<u4")
    n = len(arr) // block_size
    data = arr[: n * block_size].tobytes()
    step = 4 * block_size
    out = []
    h = parent & _U64
    digest = xxhash.xxh3_64_intdigest
    for i in range(n):
        h = digest(h.to_bytes(8, "little") + data[i * step : (i + 1) * step])
        out.append(h)
    return out


def block_hashes(
    tokens: Sequence[int] | npt.NDArray[np.integer], model_name: str, block_size: int = DEFAULT_BLOCK_SIZE
) -> list[int]:
    """Hashes of every full block of ``tokens`` from the start of the sequence."""
    return chain(root_hash(model_name), tokens, block_size)
