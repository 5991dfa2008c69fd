"""The in-memory prefix index: one process's dicts (radixserve.common.prefix_index has the contract).

Entries are (block, holder) -> tier, a holder being a pod (its device and host tiers, and its disk
when it has no shared location) or a shared disk location (``@<directory id>``: the blocks any of its
pods reported ``stored_disk``). A location's entries outlive a pod's ``cleared`` (its files stay) and
go with the last pod that reported under it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

from radixserve.common.kv_tier import DISK, LOCATION_MARK, TierMatch, disk_location_key
from radixserve.common.prefix_index_input import (
    Load,
    check_pod,
    clean_hashes,
    clean_load,
    clean_location,
    clean_stored,
)

log = logging.getLogger("radixserve.common.prefix_index")


class InMemoryPrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tiers: dict[int, dict[str, int]] = {}  # block hash -> holder -> tier
        self._blocks_of: dict[str, set[int]] = {}  # pod -> the blocks it reported (any tier)
        self._location_of: dict[str, str] = {}  # pod -> the key of its shared disk location
        self._at_location: dict[str, set[int]] = {}  # location key -> its blocks
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
        loc = disk_location_key(loc) if loc else ""
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
                self._set(h, loc, DISK)
                self._at_location.setdefault(loc, set()).add(h)
                self._unset(h, pod)
            else:
                self._set(h, pod, tier)
        unheld = 0
        for h in removed:
            if h not in mine:  # never stored (or already removed): touches no other pod's entry
                unheld += 1
                continue
            mine.discard(h)
            if not self._unset(h, pod) and loc:  # it was on the shared disk: its file went
                self._unset(h, loc)
                self._at_location.get(loc, set()).discard(h)
        if unheld:  # as RedisPrefixIndex: normal when a block is stored and removed between updates
            log.debug("prefix index: %d removed block(s) of %s were not in the index", unheld, pod)

    def _set(self, h: int, holder: str, tier: int) -> None:
        self._tiers.setdefault(h, {})[holder] = tier

    def _unset(self, h: int, holder: str) -> bool:
        """Drop ``holder``'s entry of ``h``; whether it had one."""
        held = self._tiers.get(h)
        if held is None or held.pop(holder, None) is None:
            return False
        if not held:
            del self._tiers[h]
        return True

    def _drop_blocks(self, pod: str) -> None:
        """The pod's own entries (its shared location's stay: the files outlive its tree)."""
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
            for h in self._at_location.pop(loc, ()):
                self._unset(h, loc)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        return {p: m.blocks for p, m in self.match_tiers(hashes).items()}

    def match_tiers(
        self, hashes: Sequence[int], locations: Mapping[str, str] | None = None
    ) -> dict[str, TierMatch]:
        """Per pod, its leading blocks by the best tier it can load each from: its own, or (disk) its
        shared location's, ``locations`` naming each pod's (a pod left out: its own entries only)."""
        hashes = clean_hashes(hashes, "a lookup", "looked-up", chain=True)
        pods_at: dict[str, list[str]] = {}  # location key -> the pods that load from it
        for pod, location in (locations or {}).items():
            if location:
                pods_at.setdefault(disk_location_key(location), []).append(pod)
        counts: dict[str, TierMatch] = {}
        alive: set[str] | None = None
        for h in hashes:
            best: dict[str, int] = {}  # pod -> the best tier it can load ``h`` from
            for holder, tier in self._tiers.get(h, {}).items():
                # a location's blocks count for the pods that load from it (others: not pods)
                for pod in pods_at.get(holder, ()) if holder.startswith(LOCATION_MARK) else (holder,):
                    best[pod] = min(tier, best.get(pod, tier))
            alive = set(best) if alive is None else alive & best.keys()
            if not alive:
                break
            for p in alive:
                counts[p] = counts.get(p, TierMatch()).plus(best[p])
        return counts

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
