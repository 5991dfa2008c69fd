"""The prefix index's input checks (radixserve.common.prefix_index): what a pod may write.

A block hash that is not an int in [0, 2**64) is dropped (a chain ends there), a pod's name must be
printable without spaces (and not a disk location's ``@`` name), and a load field that is not a short
string, a finite number, a bool or null is dropped; each is logged, none raises past the caller.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TypeAlias, cast

from radixserve.common.kv_tier import DEVICE, DISK, HOST, LOCATION_MARK

log = logging.getLogger("radixserve.common.prefix_index")

# A pod's load report (its heartbeat): a JSON object (Redis stores it as JSON text).
Load: TypeAlias = dict[str, object]

_HASH_END = 1 << 64  # block hashes are unsigned 64-bit (radixserve.common.block_hash)
_MAX_LOAD_FIELDS = 64
_MAX_LOAD_STR = 256
_MAX_POD_LEN = 256


def clean_hashes(hashes: Sequence[object], pod: str, what: str, chain: bool = False) -> list[int]:
    """``hashes`` without the ones that cannot be block hashes (each a warning); ``chain``: a
    prompt's chain, which ends at the first bad one."""
    ok = [type(h) is int and 0 <= h < _HASH_END for h in hashes]
    if all(ok):
        return list(hashes)  # type: ignore[arg-type]  # every one an int, checked above
    bad = [h for h, good in zip(hashes, ok, strict=True) if not good]
    end = ok.index(False) if chain else len(hashes)
    out = cast(list[int], [h for h, good in zip(hashes[:end], ok, strict=False) if good])
    log.warning(
        "prefix index: %d %s block hash(es) of %s ignored, not ints in [0, 2**64): %s",
        len(bad),
        what,
        pod,
        ", ".join(repr(b)[:40] for b in bad[:3]),
    )
    return out


def clean_stored(stored: Sequence[object], tiers: Sequence[object], pod: str) -> list[tuple[int, int]]:
    """(hash, tier) of each stored block: ``tiers`` runs along ``stored`` (none: all on the device,
    what a pod from before tiers sends); a tier that is not DEVICE/HOST/DISK counts as DEVICE, and
    tiers of another length than the hashes are all ignored (each a warning)."""
    if tiers and len(tiers) != len(stored):
        log.warning("prefix index: %d tiers for %d blocks of %s: all device", len(tiers), len(stored), pod)
        tiers = ()
    hashes = clean_hashes(stored, pod, "stored")
    if not tiers:
        return [(h, DEVICE) for h in hashes]
    kept = [t for h, t in zip(stored, tiers, strict=True) if type(h) is int and 0 <= h < _HASH_END]
    known = [t if type(t) is int and t in (DEVICE, HOST, DISK) else DEVICE for t in kept]
    if known != kept:
        log.warning(
            "prefix index: unknown tier(s) of %s taken as device: %s", pod, [repr(t)[:20] for t in kept][:3]
        )
    return list(zip(hashes, known, strict=True))


def check_pod(pod: object) -> str:
    """A pod's name (its advertised address) as keys may hold it: a printable str, no spaces, not
    starting with a disk location's mark."""
    if (
        not isinstance(pod, str)
        or not 0 < len(pod) <= _MAX_POD_LEN
        or not pod.isprintable()
        or " " in pod
        or pod.startswith(LOCATION_MARK)
    ):
        raise ValueError(
            f"pod name {pod!r}: expected 1-{_MAX_POD_LEN} printable characters without spaces,"
            f" not starting with {LOCATION_MARK!r}"
        )
    return pod


def clean_location(location: object, pod: str) -> str:
    """A pod's shared disk location as keys may hold it ("": none): printable, no spaces. Another
    (a warning): "", so its disk blocks count as the pod's own."""
    if location == "":
        return ""
    ok = isinstance(location, str) and 0 < len(location) < _MAX_POD_LEN and location.isprintable()
    if ok and " " not in str(location):
        return str(location)
    log.warning(
        "prefix index: disk location %r of %s is not printable text without spaces: ignored", location, pod
    )
    return ""


def clean_load(load: object, pod: str = "?") -> Load:
    """``load`` with only the fields a heartbeat may carry (str keys; short str, finite int/float,
    bool, None values); others dropped with a warning. Not a mapping at all: ``{}``."""
    if not isinstance(load, Mapping):
        log.warning("prefix index: load of %s is a %s, not a mapping: sent as {}", pod, type(load).__name__)
        return {}
    out: Load = {}
    dropped: list[str] = []
    for k, v in load.items():
        ok = isinstance(k, str) and 0 < len(k) <= _MAX_LOAD_STR and len(out) < _MAX_LOAD_FIELDS
        if ok and isinstance(v, float):
            ok = math.isfinite(v)
        elif ok and isinstance(v, str):
            ok = len(v) <= _MAX_LOAD_STR
        elif ok:
            ok = v is None or isinstance(v, bool) or (isinstance(v, int) and -(1 << 63) <= v < _HASH_END)
        if ok:
            out[k] = v
        else:
            dropped.append(repr(k)[:40])
    if dropped:
        log.warning("prefix index: load fields of %s dropped (not a short str/number/bool): %s", pod, dropped)
    return out
