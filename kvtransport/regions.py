"""Where registered memory lies, as arrays, so every segment of a transfer is range-checked
at once (T4) instead of one Python step per segment.

:class:`RegionIndex` answers "which absolute addresses do these segments name, and are they
inside their regions?" for one side of a transfer: a peer's exported regions
(:class:`~kvtransport.peer.Peer`) or the agent's own (:class:`LocalRegions`).
:class:`LocalRegions` is the agent's table of what it registered, with the index rebuilt on
each change and a generation that tells a prepared transfer whether to re-check its regions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from .errors import InvalidSegmentsError, UnregisteredMemoryError
from .memory import MemoryRegion

__all__ = ["RegionIndex", "LocalRegions"]

_U64 = np.uint64


class RegionIndex:
    """Sorted id -> (base, length) arrays for vectorised range checks."""

    def __init__(self, ids: np.ndarray, addrs: np.ndarray, lens: np.ndarray):
        self.ids, self.addrs, self.lens = ids, addrs, lens

    @classmethod
    def of(cls, regions: Iterable[tuple[int, int, int]]) -> RegionIndex:
        """The index of ``(id, addr, length)`` triples, in any order."""
        rows = sorted(regions)
        return cls(np.array([r[0] for r in rows], dtype=np.int64),
                   np.array([r[1] for r in rows], dtype=_U64),
                   np.array([r[2] for r in rows], dtype=_U64))

    def resolve(self, region: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str,
                owner: str) -> np.ndarray:
        """Absolute addresses for the segments, or raise naming the first bad one."""
        if self.ids.size == 0:
            raise UnregisteredMemoryError(
                f"{side} segments refer to {owner}, which has no registered memory"
            )
        idx = np.searchsorted(self.ids, region)
        idx_c = np.minimum(idx, self.ids.size - 1)
        known = self.ids[idx_c] == region
        if not known.all():
            bad = int(region[np.flatnonzero(~known)[0]])
            raise UnregisteredMemoryError(
                f"{side} segment refers to region {bad}, which is not registered on {owner}; "
                f"registered ids: {self.ids.tolist()[:16]}"
            )
        rlen = self.lens[idx_c]
        inside = (offset <= rlen) & (length <= rlen - np.minimum(offset, rlen))
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise InvalidSegmentsError(
                f"{side} segment {i} [offset {int(offset[i])}, +{int(length[i])}) lies outside "
                f"region {int(region[i])} of {int(rlen[i])} bytes on {owner}"
            )
        return self.addrs[idx_c] + offset

    def addresses(self, region: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """Absolute addresses of segments already checked by ``resolve``."""
        return self.addrs[np.searchsorted(self.ids, region)] + offset


class LocalRegions:
    """The regions an agent registered, each with the blob its backend returned for peers.

    Not thread-safe by itself: the agent changes it under its lock. ``index`` is replaced
    (never changed in place) on every change, and ``generation`` is bumped by every removal,
    so a :class:`~kvtransport.transfer.PreparedTransfer` made at another generation knows to
    check that its regions are still registered."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._regions: dict[int, tuple[MemoryRegion, bytes]] = {}
        self.index = RegionIndex.of(())
        self.generation = 0

    def next_id(self) -> int:
        """The id of the next region to register (ids are never reused)."""
        return next(self._ids)

    def add(self, region: MemoryRegion, blob: bytes) -> None:
        self._regions[region.id] = (region, blob)
        self._reindex()

    def remove(self, region_id: int) -> None:
        self._regions.pop(region_id)
        self.generation += 1
        self._reindex()

    def get(self, region_id: int) -> MemoryRegion | None:
        entry = self._regions.get(region_id)
        return None if entry is None else entry[0]

    def __contains__(self, region_id: object) -> bool:
        return region_id in self._regions

    def __len__(self) -> int:
        return len(self._regions)

    def regions(self) -> list[MemoryRegion]:
        return [r for r, _ in self._regions.values()]

    def exported(self) -> list[tuple[MemoryRegion, bytes]]:
        """Each region with its backend's blob, in registration order (for the metadata)."""
        return list(self._regions.values())

    def _reindex(self) -> None:
        self.index = RegionIndex.of((r.id, r.addr, r.length) for r, _ in self._regions.values())
