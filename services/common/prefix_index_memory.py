"""The in-memory prefix index: one process's dicts (radixserve.common.prefix_index has the contract).

Entries are (block, pod) -> tier (its device, its host, or a disk of its own) and (block, shared
disk directory): the blocks any pod mounting it reported ``stored_disk``. A directory's entries outlive
a pod's ``cleared`` (its files stay) and go with the last pod that reported under it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

from radixserve.common.kv_tier import DISK, TierMatch
from radixserve.common.prefix_index_input import (
    Load,
    check_pod,
    clean_hashes,
    clean_load,
    clean_location,
    clean_stored,
)

log = logging.getLogger("radixserve.common.prefix_index")
_NO_DIRS: frozenset[str] = frozenset()


class InMemoryPrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tiers: dict[int, dict[str, int]] = {}  # block hash -> pod -> its tier there
        self._on_disk: dict[int, set[str]] = {}  # block hash -> the shared directories holding it
        self._blocks_of: dict[str, set[int]] = {}  # pod -> the blocks it reported (any tier)
        self._location_of: dict[str, str] = {}  # pod -> its shared directory
        self._at_location: dict[str, set[int]] = {}  # shared directory -> its blocks
        self._heartbeats: dict[str, tuple[Load, float]] = {}  # pod -> (load, expires at)

    def apply(
        self,
        pod: str,
        stored: Sequence[int],
        removed: Sequence[int],
        cleared: bool = False,
        tiers: Sequence[int] = (),
        location: str = "",
    ) -> None:
        check_pod(pod)
        loc = clean_location(location, pod)
        pairs, removed = clean_stored(stored, tiers, pod), clean_hashes(removed, pod, "removed")
        if cleared:
            self._drop_blocks(pod)
        if loc:
            self._location_of[pod] = loc
        # a pod that only removes (blocks it never announced) gets no entry: nothing to hold
        mine = self._blocks_of.setdefault(pod, set()) if pairs else self._blocks_of.get(pod, set())
        for h, tier in pairs:
            mine.add(h)
            if tier == DISK and loc:  # on the shared directory, not on the pod any more
                self._on_disk.setdefault(h, set()).add(loc)
                self._at_location.setdefault(loc, set()).add(h)
                self._unset(h, pod)
            else:
                self._tiers.setdefault(h, {})[pod] = tier
        unheld = 0
        for h in removed:
            if h not in mine:  # never stored (or already removed): touches no other pod's entry
                unheld += 1
                continue
            mine.discard(h)
            if not self._unset(h, pod) and loc:  # it was on the shared disk: its file went
                self._off_disk(h, loc)
        if unheld:  # as RedisPrefixIndex: normal when a block is stored and removed between updates
            log.debug("prefix index: %d removed block(s) of %s were not in the index", unheld, pod)

    def _unset(self, h: int, pod: str) -> bool:
        """Drop ``pod``'s own entry of ``h``; whether it had one."""
        held = self._tiers.get(h)
        if held is None or held.pop(pod, None) is None:
            return False
        if not held:
            del self._tiers[h]
        return True

    def _off_disk(self, h: int, loc: str) -> None:
        self._at_location.get(loc, set()).discard(h)
        dirs = self._on_disk.get(h)
        if dirs is not None:
            dirs.discard(loc)
            if not dirs:
                del self._on_disk[h]

    def _drop_blocks(self, pod: str) -> None:
        """The pod's own entries (its shared directory's stay: the files outlive its tree)."""
        for h in self._blocks_of.pop(pod, ()):
            self._unset(h, pod)

    def heartbeat(self, pod: str, load: Load, ttl_s: float) -> bool:
        check_pod(pod)
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"heartbeat ttl_s={ttl_s}: expected a positive number of seconds")
        now = self._clock()
        prev = self._heartbeats.get(pod)
        self._heartbeats[pod] = (clean_load(load, pod), now + ttl_s)
        return prev is not None and prev[1] > now

    def remove_pod(self, pod: str) -> None:
        self._drop_blocks(pod)
        self._heartbeats.pop(pod, None)
        loc = self._location_of.pop(pod, None)
        if loc is not None and loc not in self._location_of.values():  # its last pod: nobody loads them
            for h in self._at_location.pop(loc, ()):  # (none: no pod wrote a block there yet)
                self._off_disk(h, loc)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        return {p: m.blocks for p, m in self.match_tiers(hashes).items()}

    def match_tiers(
        self, hashes: Sequence[int], locations: Mapping[str, str] | None = None
    ) -> dict[str, TierMatch]:
        """Per pod, its leading blocks by the best tier it can load each from: its own, or (disk) its
        shared location's, ``locations`` naming each pod's (a pod left out: its own entries only)."""
        hashes = clean_hashes(hashes, "a lookup", "looked-up", chain=True)
        location_of = {pod: loc for pod, loc in (locations or {}).items() if loc}
        pods_at: dict[str, list[str]] = {}  # shared directory -> the pods that load from it
        for pod, loc in location_of.items():
            pods_at.setdefault(loc, []).append(pod)
        counts: dict[str, list[int]] = {}  # pod -> blocks on each tier so far
        alive: set[str] | None = None  # the pods that matched every block so far
        for h in hashes:
            own = self._tiers.get(h, {})  # pod -> its own tier of ``h``
            dirs = self._on_disk.get(h, _NO_DIRS) if pods_at else _NO_DIRS  # shared ones holding ``h``
            if alive is None:
                alive = set(own).union(*(pods_at.get(d, ()) for d in dirs))
                counts = {pod: [0, 0, 0] for pod in alive}
            missed = []
            for pod in alive:  # its own entry first: never worse than its directory's (disk)
                tier = own.get(pod, DISK if location_of.get(pod) in dirs else None)
                if tier is None:
                    missed.append(pod)
                else:
                    counts[pod][tier] += 1
            alive.difference_update(missed)
            if not alive:
                break
        return {pod: TierMatch(*c) for pod, c in counts.items()}

    def live_pods(self) -> dict[str, Load]:
        now = self._clock()
        return {p: load for p, (load, exp) in self._heartbeats.items() if exp > now}

    def sweep(self) -> list[str]:
        now = self._clock()
        dead = [p for p, (_, exp) in self._heartbeats.items() if exp <= now]
        dead += [p for p in self._blocks_of if p not in self._heartbeats]
        for p in dead:
            self.remove_pod(p)
        return dead

    def num_blocks(self, pod: str) -> int:
        return len(self._blocks_of.get(pod, ()))
