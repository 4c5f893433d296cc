"""A connected peer, and the checks a peer's metadata must pass before it becomes one.

:class:`Peer` is what ``Agent.connect`` returns: the peer's exported regions (indexed for
vectorised range checks of the remote side of a transfer) and the backend's handle of the
connection. A newer ``connect`` of the same name replaces it; the stale object still names
the old connection (``Agent.peer_alive`` answers for that process).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import IncompatiblePeerError, LayoutMismatchError, UnknownPeerError, UnregisteredMemoryError
from .memory import RemoteMemoryRegion
from .metadata import AgentMetadata
from .regions import RegionIndex

__all__ = ["Peer", "check_peer", "check_compatible"]


class Peer:
    """A connected peer. Obtained from :meth:`Agent.connect`; stale once replaced.

    ``_handle`` (the backend's name for the connection) and ``_index`` (the peer's regions,
    for range checks) belong to the core's agent and transfer preparation, not to callers."""

    def __init__(self, name: str, instance: str, regions: list[RemoteMemoryRegion], handle: Any,
                 layout: Mapping[str, Any] | None):
        self.name = name
        self.instance = instance
        self.regions = regions
        self.layout = dict(layout) if layout else None
        self._handle = handle
        ids = np.array([r.id for r in regions], dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        self._index = RegionIndex(
            ids[order],
            np.array([r.addr for r in regions], dtype=np.uint64)[order],
            np.array([r.length for r in regions], dtype=np.uint64)[order],
        )
        self._by_id = {r.id: r for r in regions}

    def region(self, region_id: int) -> RemoteMemoryRegion:
        try:
            return self._by_id[region_id]
        except KeyError:
            raise UnregisteredMemoryError(
                f"peer {self.name!r} exported no region {region_id}; it has {sorted(self._by_id)}"
            ) from None

    def __repr__(self) -> str:
        return f"Peer({self.name!r}, regions={len(self.regions)})"


def check_peer(peer: Any) -> None:
    """Refuse anything but a :class:`Peer` with a typed error (callers pass strings, names)."""
    if not isinstance(peer, Peer):
        raise UnknownPeerError(
            f"expected a kvtransport Peer (what Agent.connect() returns), got {type(peer).__name__}")


def check_compatible(md: AgentMetadata, backend_name: str, backend_version: Any,
                     layout: Mapping[str, Any] | None) -> None:
    """Refuse a peer whose metadata names another backend, backend version or KV layout
    than ours: its transfers could not work, and would fail late and obscurely."""
    if md.backend != backend_name:
        raise IncompatiblePeerError(
            f"peer {md.agent!r} uses backend {md.backend!r}, this agent uses "
            f"{backend_name!r}; open both agents with the same backend"
        )
    if md.backend_version != backend_version:
        raise IncompatiblePeerError(
            f"peer {md.agent!r} runs {md.backend} backend version {md.backend_version}, this "
            f"agent runs {backend_version}; upgrade both sides to the same release"
        )
    mine, theirs = layout, md.layout
    if mine is not None and theirs is not None and dict(mine) != dict(theirs):
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        detail = ", ".join(f"{k}: ours={mine.get(k)!r} theirs={theirs.get(k)!r}" for k in diff)
        raise LayoutMismatchError(
            f"peer {md.agent!r} has another KV layout ({detail}); both engines must use the "
            "same model, dtype and block size"
        )
