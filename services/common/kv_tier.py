"""KV tiers as the cluster sees them: where a pod holds a block, and what a hit there is worth.

A scheduler's radix cache reports each full block at the best tier it holds it on (block events,
services/scheduler/memory/radix_cache.py): ``stored`` (the device), ``stored_host``, ``stored_disk``.
The prefix index keeps that tier per (block, location), a location being a pod or a disk directory
several pods share (``disk_location``: its blocks are published under ``@<directory id>``, and every
pod mounting it can load them). The router scores a pod's matched prefix by these tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE, HOST, DISK = 0, 1, 2
TIER_NAMES = ("device", "host", "disk")
# The block events that store a block, by the tier they name.
STORED_EVENTS = {"stored": DEVICE, "stored_host": HOST, "stored_disk": DISK}
LOCATION_MARK = "@"  # a disk location's entries in the index: "@<directory id>" (never a pod's name)


def disk_location_key(location: str) -> str:
    """The index's name for a shared disk directory's entries."""
    return LOCATION_MARK + location


@dataclass(frozen=True, slots=True)
class TierMatch:
    """A pod's leading matched blocks, counted by the best tier it can load each from."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What one matched block is worth to the router, by the tier it is on (--tier-weight-*)."""

    device: float = 1.0
    host: float = 0.8
    disk: float = 0.5

    def __post_init__(self) -> None:
        for name in TIER_NAMES:
            w = getattr(self, name)
            if not 0.0 <= w <= 1.0:  # NaN fails too
                raise ValueError(f"--tier-weight-{name}={w}: expected a weight in [0, 1]")
        if not self.device >= self.host >= self.disk:
            raise ValueError(
                f"--tier-weight-device={self.device}, --tier-weight-host={self.host},"
                f" --tier-weight-disk={self.disk}: expected device >= host >= disk"
            )

    def score(self, m: TierMatch) -> float:
        """A matched prefix's worth: the sum of its blocks' weights."""
        return self.device * m.device + self.host * m.host + self.disk * m.disk
