"""Everything checked before a backend sees a transfer (T4), and the transfer made ready.

A backend is handed only what it can move: memory kinds it declared, a connected peer,
segments that lie inside registered regions of the right agent and pair up with equal
lengths, a sane timeout and notification. Every check runs with numpy over whole arrays,
so bad input never reaches a backend and no byte moves; every refusal is a typed error
naming the problem and the fix.

:class:`TransferPreparer` does this once per :meth:`Agent.prepare` (or ``read``/``write``)
and merges runs contiguous on both sides, producing a
:class:`~kvtransport.transfer.PreparedTransfer`; :meth:`TransferPreparer.check` re-checks
in O(1) only what can have changed before each post of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .errors import (BackendOptionError, InvalidSegmentsError, StalePreparedTransferError, UnknownPeerError,
                     UnsupportedMemoryKindError)
from .peer import Peer, check_peer
from .regions import LocalRegions
from .registry import available_backends, backends_for_memory_kind
from .segments import Segments, merge_pairs
from .spi import Backend, Op, PostRequest
from .transfer import PreparedTransfer

__all__ = ["TransferPreparer", "check_timeout"]


def check_timeout(value: Any) -> float:
    """``value`` as a positive, finite number of seconds, or a typed error."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise InvalidSegmentsError(f"timeout must be a number of seconds, got {value!r}") from None
    if not math.isfinite(t) or t <= 0:
        raise InvalidSegmentsError(f"timeout must be a positive, finite number of seconds, got {value!r}")
    return t


def _backends_accepting(kind: str, remote: bool) -> list[str]:
    """Installed backends that declare ``kind`` for our own regions, or for a peer's
    (``remote``); for the message of a refusal only (it probes every backend)."""
    if not remote:
        return backends_for_memory_kind(kind)
    return [i.name if i.usable else f"{i.name} (not usable here)" for i in available_backends()
            if i.capabilities is not None and kind in i.capabilities.remote_memory_kinds]


def _distinct(ids: np.ndarray) -> np.ndarray:
    """``np.unique`` with a fast path for the common single-region transfer."""
    if ids.size == 1 or (ids.size and bool((ids == ids[0]).all())):
        return ids[:1].copy()
    return np.unique(ids)


class TransferPreparer:
    """The agent's gate between callers and its backend (T4).

    Holds the agent's live state by reference (its registered regions, its table of
    connected peers, its open check), never a copy, and is called under the agent's lock."""

    def __init__(self, backend: Backend, agent_name: str, agent_instance: str, regions: LocalRegions,
                 peers: Mapping[str, Peer], default_timeout_s: Callable[[], float],
                 check_open: Callable[[], None]):
        self._backend = backend
        self._backend_name = backend.name
        self._agent_name = agent_name
        self._agent_instance = agent_instance
        self._regions = regions
        self._peers = peers
        self._default_timeout_s = default_timeout_s
        self._check_open = check_open

    def check_memory_kind(self, kind: str, where: str, remote: bool = False) -> None:
        """Refuse memory the backend does not declare, before the backend sees it.

        This is the one gate that keeps device memory away from CPU-only data paths (the
        loopback memmove and process_vm_* copies, numpy views): a backend is handed only
        kinds it declared, for its own regions (``capabilities.memory_kinds``) and for a
        peer's (``capabilities.remote_memory_kinds``: a peer's device memory is the peer's
        transport's business where the bytes cross through it, so a CPU-only agent on
        ucx/nixl pairs with a GPU engine). The message names the installed backends that
        can move the kind on that side."""
        caps = self._backend.capabilities
        accepted = caps.remote_memory_kinds if remote else caps.memory_kinds
        if kind in accepted:
            return
        others = [b for b in _backends_accepting(kind, remote) if b.split(" ")[0] != self._backend_name]
        raise UnsupportedMemoryKindError(self._backend_name, kind, sorted(accepted), others, where)

    def check_notify(self, notify: Any) -> bytes:
        """A notification to attach to a transfer, as bytes, if the backend can attach one."""
        if not self._backend.capabilities.notify:
            raise BackendOptionError(f"backend {self._backend_name!r} cannot attach notifications")
        if not isinstance(notify, (bytes, bytearray)):
            raise InvalidSegmentsError(f"notify must be bytes, got {type(notify).__name__}")
        return bytes(notify)

    def check(self, p: PreparedTransfer) -> None:
        """O(1) re-validation of a preparation (O(regions used) after a deregister)."""
        if p.agent_instance != self._agent_instance:
            raise StalePreparedTransferError(
                f"this transfer was prepared by another agent, not {self._agent_name!r}; prepare it "
                "on the agent that posts it")
        self._check_open()
        if self._peers.get(p.peer.name) is not p.peer:
            raise StalePreparedTransferError(
                f"prepared transfer to peer {p.peer.name!r} is stale: the peer was disconnected "
                "or replaced by a newer connect() since prepare(); prepare it again with the "
                "current Peer")
        if p.regions_generation != self._regions.generation:
            gone = [rid for rid in p.local_region_ids.tolist() if rid not in self._regions]
            if gone:
                raise StalePreparedTransferError(
                    f"prepared transfer uses local region(s) {gone[:8]}, deregistered from "
                    f"{self._agent_name!r} since prepare(); register the memory and prepare again")

    def prepare(self, op: Op, peer: Peer, local: Segments, remote: Segments,
                notify: bytes | None, timeout: float | None) -> PreparedTransfer:
        """Validation (T4) and merging of one transfer; nothing is posted."""
        if not isinstance(op, Op):
            raise InvalidSegmentsError(f"op must be kvtransport.Op.READ or Op.WRITE, got {op!r}")
        check_peer(peer)
        caps = self._backend.capabilities
        if (op is Op.READ and not caps.read) or (op is Op.WRITE and not caps.write):
            raise BackendOptionError(f"backend {self._backend_name!r} does not support {op.name}")
        if notify is not None:
            notify = self.check_notify(notify)
        if not isinstance(local, Segments) or not isinstance(remote, Segments):
            raise InvalidSegmentsError("local and remote must be kvtransport.Segments")
        if len(local) != len(remote):
            raise InvalidSegmentsError(
                f"local has {len(local)} segments, remote has {len(remote)}; they pair one to one"
            )
        if len(local) == 0:
            raise InvalidSegmentsError("nothing to transfer (0 segments); use send_notification "
                                       "for a message without data")
        if not np.array_equal(local.length, remote.length):
            i = int(np.flatnonzero(local.length != remote.length)[0])
            raise InvalidSegmentsError(
                f"segment {i}: local length {int(local.length[i])} != remote length "
                f"{int(remote.length[i])}; paired segments must have equal lengths"
            )
        if not local.length.all():
            raise InvalidSegmentsError("segment lengths must be positive")
        timeout_s = check_timeout(self._default_timeout_s() if timeout is None else timeout)
        self._check_open()
        if self._peers.get(peer.name) is not peer:
            raise UnknownPeerError(
                f"peer {peer.name!r} is not connected to {self._agent_name!r} (never connected, "
                "disconnected or replaced by a newer connect); connect() it first"
            )
        # Range checks on the caller's segments (errors name the caller's index),
        # then merging of what is known to be valid.
        index = self._regions.index
        index.resolve(local.region, local.offset, local.length, "local", f"agent {self._agent_name!r}")
        peer._index.resolve(remote.region, remote.offset, remote.length, "remote", f"peer {peer.name!r}")
        lr, lo, rr, ro, ln = merge_pairs(local, remote)
        laddr = index.addresses(lr, lo)
        raddr = peer._index.addresses(rr, ro)
        for a in (lr, lo, rr, ro, ln, laddr, raddr):  # shared by every post of it
            a.flags.writeable = False
        used = _distinct(lr)
        used.flags.writeable = False
        req = PostRequest(op, 0, peer._handle, peer.name, lr, lo, laddr, rr, ro, raddr, ln)
        return PreparedTransfer(op, peer, req.nbytes, int(ln.size), len(local), notify, timeout_s,
                                req, used, self._agent_instance, self._regions.generation)
