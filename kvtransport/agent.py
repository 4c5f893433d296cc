"""The agent: the one core every backend gets for free.

An :class:`Agent` owns one backend instance and adds what must hold for all of them:

* validation before posting (T4): every byte of every segment inside a registered
  region of the right agent, lengths equal, peer connected, agent open — checked with
  numpy over whole arrays, so bad input never reaches a backend and no byte moves;
* contiguous-run merging, so backends see few large operations;
* deadlines (T2): polling fails a transfer whose deadline passed even if the backend
  is silent, then cancels it in the backend and tracks quiescence (T3);
* exactly-once completion (T1): :meth:`Agent.progress` reports each transfer that
  became terminal at most once, and holds none the caller has already seen end
  (bounded memory; see :class:`~kvtransport.transfer.FinishedTransfers`);
* prepared transfers (:meth:`Agent.prepare` once, :meth:`Agent.post` many times);
* typed errors only: whatever a backend raises reaches the caller as a
  :mod:`kvtransport.errors` type naming the problem and the fix;
* metrics and fault injection.

Progress is driven by the caller (``Transfer.status/wait``, ``Agent.progress``), as in
NIXL's agent; backends that need background progress run their own thread. A
:class:`~kvtransport.transfer.Transfer` reaches its agent only through the small
:class:`~kvtransport.transfer.TransferOwner` protocol (implemented here by
``_TransferOwner``), and the agent changes a Transfer only through its owner side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import metadata as md_mod
from .errors import (
    AgentClosedError,
    BackendOptionError,
    BackendUnavailableError,
    IncompatiblePeerError,
    InvalidSegmentsError,
    KVTransportError,
    LayoutMismatchError,
    NotificationError,
    PeerMetadataError,
    StalePreparedTransferError,
    UnknownPeerError,
    UnregisteredMemoryError,
    UnsupportedMemoryKindError,
    UnsupportedOperationError,
)
from .faults import FaultInjectingBackend, FaultPlan, plan_from_options
from .memory import MemoryRegion, RemoteMemoryRegion, describe_buffer
from .registry import available_backends, backends_for_memory_kind, load_backend_class, probe_class
from .segments import Segments, merge_pairs
from .spi import Backend, LocalRegion, Op, PollState, PostRequest, RemoteRegion
from .transfer import (DONE_STATUS, FinishedTransfers, PreparedTransfer, State, Transfer, TransferStatus,
                       note_pending_poll)

__all__ = ["AgentConfig", "Agent", "Peer", "Notification", "PreparedTransfer", "open_agent"]

_U64 = np.uint64


@dataclass
class AgentConfig:
    """Core settings, kept apart from backend options (which go to the backend as-is)."""

    name: str | None = None
    #: Deadline of a transfer when ``read``/``write`` get no ``timeout``.
    default_timeout_s: float = 30.0
    max_metadata_bytes: int = md_mod.MAX_METADATA_BYTES
    #: Optional KV layout facts; a peer declaring a different layout is refused.
    layout: dict[str, str | int] | None = None
    faults: FaultPlan | None = None
    #: Latency samples kept for percentiles.
    latency_window: int = 4096
    #: Finished transfers whose end a ``status()``/``wait()`` already returned are held
    #: for :meth:`Agent.progress` only weakly; the latest ``progress_window`` of them are
    #: held strongly too, so a caller who waits, drops the handle and drains ``progress()``
    #: soon after still sees them. Memory stays bounded either way.
    progress_window: int = 1024


@dataclass(frozen=True)
class Notification:
    peer: str
    payload: bytes


class Peer:
    """A connected peer. Obtained from :meth:`Agent.connect`; stale once replaced."""

    def __init__(self, name: str, instance: str, regions: list[RemoteMemoryRegion], handle: Any,
                 layout: Mapping[str, Any] | None):
        self.name = name
        self.instance = instance
        self.regions = regions
        self.layout = dict(layout) if layout else None
        self._handle = handle
        ids = np.array([r.id for r in regions], dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        self._index = _RegionIndex(
            ids[order],
            np.array([r.addr for r in regions], dtype=_U64)[order],
            np.array([r.length for r in regions], dtype=_U64)[order],
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


class _RegionIndex:
    """Sorted id -> (base, length) arrays for vectorised range checks."""

    def __init__(self, ids: np.ndarray, addrs: np.ndarray, lens: np.ndarray):
        self.ids, self.addrs, self.lens = ids, addrs, lens

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


def _check_timeout(value: Any) -> float:
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise InvalidSegmentsError(f"timeout must be a number of seconds, got {value!r}") from None
    if not math.isfinite(t) or t <= 0:
        raise InvalidSegmentsError(f"timeout must be a positive, finite number of seconds, got {value!r}")
    return t


def _check_peer(peer: Any) -> None:
    if not isinstance(peer, Peer):
        raise UnknownPeerError(
            f"expected a kvtransport Peer (what Agent.connect() returns), got {type(peer).__name__}")


class Agent:
    """One endpoint of KV transfers. Create with :func:`kvtransport.open`."""

    def __init__(self, backend: Backend, config: AgentConfig):
        self.config = config
        self.name = backend.agent_name
        self.backend_name = backend.name
        self.instance = secrets.token_hex(8)
        self._backend = backend
        self._lock = threading.RLock()
        # Backends signal state changes here so Transfer.wait wakes without polling.
        self._progress_cond = threading.Condition()
        self._progress_gen = 0
        b: Any = backend
        while b is not None:  # the backend, and the real one under a fault injector
            b.progress_callback = self._on_backend_progress
            b = getattr(b, "inner", None)
        self._closed = False
        self._region_ids = itertools.count(1)
        self._tids = itertools.count(1)
        self._regions: dict[int, tuple[MemoryRegion, bytes]] = {}
        self._local_index = _RegionIndex(np.empty(0, np.int64), np.empty(0, _U64), np.empty(0, _U64))
        self._peers: dict[str, Peer] = {}
        # Bumped by every deregister: a PreparedTransfer made at another generation
        # re-checks that its local regions are still registered.
        self._regions_gen = 0
        # Per-transfer state, each entry removed when the transfer leaves that state:
        # pending until terminal, unquiesced until the backend promises nothing lands,
        # finished until progress() returns it or the caller has seen it end.
        self._pending: dict[int, Transfer] = {}
        self._unquiesced: dict[int, Transfer] = {}
        self._finished = FinishedTransfers(config.progress_window)
        self._idle_progress_at = 0.0  # when a progress() call that found nothing finished returned
        self._fast_idle_progress = 0  # such calls in a row, each soon after the one before (spinning)
        self._owner = _TransferOwner(self)
        self._latencies: deque[float] = deque(maxlen=config.latency_window)
        self._stats = dict(
            transfers_posted=0, transfers_done=0, transfers_failed=0, transfers_timed_out=0,
            bytes_read=0, bytes_written=0, segments_posted=0, segments_merged=0,
            notifications_received=0, peers_refused=0,
        )

    # -- properties -----------------------------------------------------------
    @property
    def faults(self) -> FaultInjectingBackend | None:
        """The fault injector when opened with ``faults=``, for tests (``kill_peer``)."""
        b = self._backend
        return b if isinstance(b, FaultInjectingBackend) else None

    @property
    def capabilities(self):
        return self._backend.capabilities

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peers(self) -> dict[str, Peer]:
        return dict(self._peers)

    @property
    def regions(self) -> list[MemoryRegion]:
        return [r for r, _ in self._regions.values()]

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosedError(self.name)

    # -- memory ---------------------------------------------------------------
    def register(self, buf: Any, kind: str | None = None, device: int | None = None) -> MemoryRegion:
        """Register memory so peers can read or write it; returns its region.

        ``buf`` is a numpy array, a torch tensor (kind and device read from it), a writable
        buffer, or a raw ``(address, length)`` pair — for which ``kind`` ("cpu", "cuda",
        "rocm") and, for device memory, ``device`` must be given."""
        addr, length, mkind, device, owner = describe_buffer(buf, kind, device)
        self._check_memory_kind(mkind, "register")
        with self._lock:
            self._check_open()
            rid = next(self._region_ids)
            region = MemoryRegion(rid, addr, length, mkind, device, owner)
            with self._backend_call(f"could not register {length} bytes of {mkind} memory at {addr:#x}"):
                blob = self._backend.register(LocalRegion(rid, addr, length, mkind, device))
            self._regions[rid] = (region, bytes(blob))
            self._rebuild_local_index()
            return region

    def _check_memory_kind(self, kind: str, where: str, remote: bool = False) -> None:
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
        others = [b for b in _backends_accepting(kind, remote) if b.split(" ")[0] != self.backend_name]
        raise UnsupportedMemoryKindError(self.backend_name, kind, sorted(accepted), others, where)

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            self._check_open()
            if not isinstance(region, MemoryRegion):
                raise UnregisteredMemoryError(
                    f"deregister() takes a MemoryRegion that register() returned, got {type(region).__name__}")
            mine = self._regions.get(region.id)
            if mine is None:
                raise UnregisteredMemoryError(f"region {region.id} is not registered on {self.name!r}")
            if (mine[0].addr, mine[0].length, mine[0].kind) != (region.addr, region.length, region.kind):
                raise UnregisteredMemoryError(
                    f"region {region.id} ({region.length} bytes at {region.addr:#x}) was not registered "
                    f"by {self.name!r} (its region {region.id} is {mine[0].length} bytes at "
                    f"{mine[0].addr:#x}); deregister it on the agent that registered it")
            for t in list(self._unquiesced.values()):  # a waiting-only caller never polls them
                if (t.local_regions == region.id).any():
                    self._check_quiesced(t)
            busy = [t.id for t in itertools.chain(self._pending.values(), self._unquiesced.values())
                    if (t.local_regions == region.id).any()]
            if busy:
                raise KVTransportError(
                    f"region {region.id} is in use by transfers {busy[:8]} (pending or not yet "
                    "quiesced); wait for them before deregistering"
                )
            # Out of the core first, whatever the backend says: no new transfer may use it.
            self._regions.pop(region.id)
            self._regions_gen += 1
            self._rebuild_local_index()
            try:
                self._backend.deregister(LocalRegion(region.id, region.addr, region.length, region.kind,
                                                     region.device))
            except Exception as exc:
                raise KVTransportError(
                    f"backend {self.backend_name!r} failed to deregister region {region.id}: "
                    f"{type(exc).__name__}: {exc}; the core no longer uses it, but the backend may "
                    "still hold the memory: keep the buffer alive until the agent is closed") from exc

    def _rebuild_local_index(self) -> None:
        ids = np.array(sorted(self._regions), dtype=np.int64)
        addrs = np.array([self._regions[i][0].addr for i in ids], dtype=_U64)
        lens = np.array([self._regions[i][0].length for i in ids], dtype=_U64)
        self._local_index = _RegionIndex(ids, addrs, lens)

    # -- peers ----------------------------------------------------------------
    def metadata(self) -> bytes:
        """Versioned blob a peer passes to its ``connect``."""
        with self._lock:
            self._check_open()
            regions = [
                md_mod.RegionDesc(r.id, r.addr, r.length, r.kind, blob)
                for r, blob in self._regions.values()
            ]
            return md_mod.encode_metadata(md_mod.AgentMetadata(
                magic=md_mod.MAGIC, protocol=md_mod.PROTOCOL_VERSION, agent=self.name,
                instance=self.instance, backend=self.backend_name,
                backend_version=self._backend.version, blob=self._exported(),
                regions=regions, layout=self.config.layout,
            ))

    def _exported(self) -> bytes:
        with self._backend_call("could not describe itself for peers"):
            return self._backend.export()

    @contextlib.contextmanager
    def _backend_call(self, failed: str, error: type[KVTransportError] = KVTransportError) -> Iterator[None]:
        """A backend's own exception reaches the caller as ``error`` saying what ``failed``
        (typed errors pass unchanged): callers are promised kvtransport errors only."""
        try:
            yield
        except KVTransportError:
            raise
        except Exception as exc:
            raise error(f"backend {self.backend_name!r} {failed}: {type(exc).__name__}: {exc}") from exc

    def connect(self, peer_metadata: bytes) -> Peer:
        """Connect to (or refresh) the peer described by ``peer_metadata``.

        A refused peer raises a typed error and changes nothing: other peers keep working.
        """
        with self._lock:
            self._check_open()
            try:
                md = md_mod.decode_metadata(peer_metadata, self.config.max_metadata_bytes)
                self._check_compatible(md)
            except (PeerMetadataError, IncompatiblePeerError):
                self._stats["peers_refused"] += 1
                raise
            if md.agent == self.name and md.instance == self.instance:
                raise IncompatiblePeerError(
                    f"agent {self.name!r} cannot connect to itself; open a second agent"
                )
            for r in md.regions:  # a peer's device region must not reach a CPU-only data path
                try:
                    self._check_memory_kind(r.kind, f"connect to peer {md.agent!r} exporting", remote=True)
                except UnsupportedMemoryKindError:
                    self._stats["peers_refused"] += 1
                    raise
            regions = [RemoteMemoryRegion(r.id, r.addr, r.length, r.kind) for r in md.regions]
            old = self._peers.get(md.agent)
            if old is not None and old.instance != md.instance:
                # Peer restarted under the same name: transfers to the old one must end.
                self._drop_peer(old, f"peer {md.agent!r} restarted")
            try:
                handle = self._backend.connect(
                    md.agent, md.blob,
                    [RemoteRegion(r.id, r.addr, r.length, r.kind, r.blob) for r in md.regions],
                )
            except KVTransportError:
                self._stats["peers_refused"] += 1
                raise
            except Exception as exc:
                self._stats["peers_refused"] += 1
                raise PeerMetadataError(
                    f"backend {self.backend_name!r} refused peer {md.agent!r}: {type(exc).__name__}: {exc}"
                ) from exc
            peer = Peer(md.agent, md.instance, regions, handle, md.layout)
            self._peers[md.agent] = peer
            return peer

    def _check_compatible(self, md: md_mod.AgentMetadata) -> None:
        if md.backend != self.backend_name:
            raise IncompatiblePeerError(
                f"peer {md.agent!r} uses backend {md.backend!r}, this agent uses "
                f"{self.backend_name!r}; open both agents with the same backend"
            )
        if md.backend_version != self._backend.version:
            raise IncompatiblePeerError(
                f"peer {md.agent!r} runs {md.backend} backend version {md.backend_version}, this "
                f"agent runs {self._backend.version}; upgrade both sides to the same release"
            )
        mine, theirs = self.config.layout, md.layout
        if mine is not None and theirs is not None and dict(mine) != dict(theirs):
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            detail = ", ".join(f"{k}: ours={mine.get(k)!r} theirs={theirs.get(k)!r}" for k in diff)
            raise LayoutMismatchError(
                f"peer {md.agent!r} has another KV layout ({detail}); both engines must use the "
                "same model, dtype and block size"
            )

    def disconnect(self, peer: Peer) -> None:
        _check_peer(peer)
        with self._lock:
            self._check_open()
            if self._peers.get(peer.name) is not peer:
                raise UnknownPeerError(f"peer {peer.name!r} is not connected to {self.name!r}")
            self._drop_peer(peer, f"peer {peer.name!r} disconnected")

    def peer_alive(self, peer: Peer) -> bool | None:
        """True: the peer's process runs; False: it is known gone, so no transfer it
        posted into our memory can land any more; None: the backend cannot tell.
        Works for a replaced or disconnected ``Peer`` too (the old process)."""
        _check_peer(peer)
        with self._lock:
            self._check_open()
            try:
                return self._backend.peer_alive(peer._handle)
            except Exception:
                return None

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        self._peers.pop(peer.name, None)
        try:
            self._backend.disconnect(peer._handle)
        finally:
            for t in list(self._pending.values()):  # also those posted on an earlier Peer of the name
                if t.peer.name == peer.name:
                    self._fail(t, reason)

    # -- data path ------------------------------------------------------------
    def read(self, peer: Peer, local: Segments, remote: Segments, *, notify: bytes | None = None,
             timeout: float | None = None) -> Transfer:
        """Copy ``remote`` (on ``peer``) into ``local``. ``notify`` reaches the peer after
        the data has moved."""
        with self._lock:
            return self._post_prepared(self._prepare(Op.READ, peer, local, remote, notify, timeout))

    def write(self, peer: Peer, local: Segments, remote: Segments, *, notify: bytes | None = None,
              timeout: float | None = None) -> Transfer:
        """Copy ``local`` into ``remote`` (on ``peer``); ``notify`` reaches the peer after
        the data landed."""
        with self._lock:
            return self._post_prepared(self._prepare(Op.WRITE, peer, local, remote, notify, timeout))

    def prepare(self, op: Op, peer: Peer, local: Segments, remote: Segments, *,
                notify: bytes | None = None, timeout: float | None = None) -> PreparedTransfer:
        """Validate (T4) and merge a transfer once, without posting it; post it with
        :meth:`post` as often as needed. Raises the typed errors ``read``/``write``
        raise; moves nothing. ``notify``/``timeout`` are the defaults of each post."""
        with self._lock:
            return self._prepare(op, peer, local, remote, notify, timeout)

    def post(self, prepared: PreparedTransfer, *, notify: bytes | None = None,
             timeout: float | None = None) -> Transfer:
        """Post a transfer made by :meth:`prepare`; each call is a new :class:`Transfer`.

        Skips the range checks and merging (the costly part for thousands of blocks) and
        re-checks only what can have changed since: this agent open, the peer still the
        current connection of its name, the local regions still registered. A preparation
        that no longer holds raises :class:`~kvtransport.errors.StalePreparedTransferError`
        (prepare again). ``notify``/``timeout`` of None mean the prepared defaults."""
        if not isinstance(prepared, PreparedTransfer):
            raise InvalidSegmentsError(
                f"post() takes what Agent.prepare() returned, got {type(prepared).__name__}; "
                "use read()/write() for one-off transfers")
        with self._lock:
            self._check_prepared(prepared)
            return self._post_prepared(prepared, notify, timeout)

    def _check_notify(self, notify: Any) -> bytes:
        if not self._backend.capabilities.notify:
            raise BackendOptionError(f"backend {self.backend_name!r} cannot attach notifications")
        if not isinstance(notify, (bytes, bytearray)):
            raise InvalidSegmentsError(f"notify must be bytes, got {type(notify).__name__}")
        return bytes(notify)

    def _check_prepared(self, p: PreparedTransfer) -> None:
        """O(1) re-validation of a preparation (O(regions used) after a deregister)."""
        if p.agent_instance != self.instance:
            raise StalePreparedTransferError(
                f"this transfer was prepared by another agent, not {self.name!r}; prepare it "
                "on the agent that posts it")
        self._check_open()
        if self._peers.get(p.peer.name) is not p.peer:
            raise StalePreparedTransferError(
                f"prepared transfer to peer {p.peer.name!r} is stale: the peer was disconnected "
                "or replaced by a newer connect() since prepare(); prepare it again with the "
                "current Peer")
        if p.regions_generation != self._regions_gen:
            gone = [rid for rid in p.local_region_ids.tolist() if rid not in self._regions]
            if gone:
                raise StalePreparedTransferError(
                    f"prepared transfer uses local region(s) {gone[:8]}, deregistered from "
                    f"{self.name!r} since prepare(); register the memory and prepare again")

    def _post_prepared(self, p: PreparedTransfer, notify: bytes | None = None,
                       timeout: float | None = None) -> Transfer:
        """Post a validated preparation (caller holds the lock and checked it)."""
        notify = p.notify if notify is None else self._check_notify(notify)
        timeout_s = p.timeout_s if timeout is None else _check_timeout(timeout)
        r = p.request
        req = PostRequest(r.op, next(self._tids), r.peer, r.peer_name, r.local_region,
                          r.local_offset, r.local_addr, r.remote_region, r.remote_offset,
                          r.remote_addr, r.length, notify, time.monotonic() + timeout_s)
        t = Transfer(self._owner, req.transfer_id, p.op, p.peer, p.nbytes, p.nsegments,
                     p.local_region_ids, req.deadline)
        st = self._stats
        st["transfers_posted"] += 1
        st["segments_posted"] += p.caller_segments
        st["segments_merged"] += p.nsegments
        self._pending[t.id] = t
        try:
            t.backend_handle = self._backend.post(req)
        except Exception as exc:  # a backend refusal fails the transfer, once, visibly
            self._fail(t, f"backend {self.backend_name!r} refused the post: "
                          f"{type(exc).__name__}: {exc}", quiesced=True)
            return t
        # One poll now, while everything is in cache: a backend that completed the copy
        # inside post (NIXL and UCX over cma, loopback in one process) is seen DONE at
        # once, instead of by a first status() that pays for evicted caches.
        self._poll_one(t, time.monotonic())
        return t

    def _prepare(self, op: Op, peer: Peer, local: Segments, remote: Segments,
                 notify: bytes | None, timeout: float | None) -> PreparedTransfer:
        """Validation (T4) and merging; caller holds the lock."""
        if not isinstance(op, Op):
            raise InvalidSegmentsError(f"op must be kvtransport.Op.READ or Op.WRITE, got {op!r}")
        _check_peer(peer)
        caps = self._backend.capabilities
        if (op is Op.READ and not caps.read) or (op is Op.WRITE and not caps.write):
            raise BackendOptionError(f"backend {self.backend_name!r} does not support {op.name}")
        if notify is not None:
            notify = self._check_notify(notify)
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
        timeout_s = _check_timeout(self.config.default_timeout_s if timeout is None else timeout)
        self._check_open()
        if self._peers.get(peer.name) is not peer:
            raise UnknownPeerError(
                f"peer {peer.name!r} is not connected to {self.name!r} (never connected, "
                "disconnected or replaced by a newer connect); connect() it first"
            )
        # Range checks on the caller's segments (errors name the caller's index),
        # then merging of what is known to be valid.
        self._local_index.resolve(local.region, local.offset, local.length, "local",
                                  f"agent {self.name!r}")
        peer._index.resolve(remote.region, remote.offset, remote.length, "remote",
                            f"peer {peer.name!r}")
        lr, lo, rr, ro, ln = merge_pairs(local, remote)
        laddr = self._local_index.addresses(lr, lo)
        raddr = peer._index.addresses(rr, ro)
        for a in (lr, lo, rr, ro, ln, laddr, raddr):  # shared by every post of it
            a.flags.writeable = False
        used = _distinct(lr)
        used.flags.writeable = False
        req = PostRequest(op, 0, peer._handle, peer.name, lr, lo, laddr, rr, ro, raddr, ln)
        return PreparedTransfer(op, peer, req.nbytes, int(ln.size), len(local), notify, timeout_s,
                                req, used, self.instance, self._regions_gen)

    # -- progress -------------------------------------------------------------
    def _on_backend_progress(self) -> None:
        with self._progress_cond:
            self._progress_gen += 1
            self._progress_cond.notify_all()

    def _poll_one(self, t: Transfer, now: float) -> None:
        h = t.backend_handle
        try:
            res = self._backend.poll(h) if h is not None else None
        except Exception as exc:
            self._fail(t, f"backend poll raised {type(exc).__name__}: {exc}")
            return
        if res is None or res.state is PollState.PENDING:
            t.awaits_signal = res is not None and res.will_signal
            if now >= t.deadline:
                self._stats["transfers_timed_out"] += 1
                self._fail(t, f"deadline of {t.deadline - t.posted_at:.3f}s passed "
                              "with no completion from the backend")
            return
        if res.state is PollState.DONE:
            if t.set_terminal(DONE_STATUS):
                self._pending.pop(t.id, None)
                self._stats["transfers_done"] += 1
                self._stats["bytes_read" if t.op is Op.READ else "bytes_written"] += t.nbytes
                self._latencies.append(t.finished_at - t.posted_at)
                self._finished.add(t)
        else:
            self._fail(t, res.reason or "backend reported failure", quiesced=res.quiesced)

    def _fail(self, t: Transfer, reason: str, quiesced: bool | None = None) -> None:
        """Fail ``t`` once. Unless the backend already said so, cancel it and learn
        whether anything can still land (T3)."""
        h = t.backend_handle
        if quiesced is None:
            try:
                quiesced = bool(self._backend.cancel(h)) if h is not None else True
            except Exception:
                quiesced = False
        if t.set_terminal(TransferStatus(State.FAILED, reason, quiesced)):
            self._pending.pop(t.id, None)
            self._stats["transfers_failed"] += 1
            if not quiesced:
                self._unquiesced[t.id] = t
            self._finished.add(t)
            # Failed by the core (close, disconnect, deadline) or the backend: wake every
            # waiter now, including one sleeping on a backend's promise to signal.
            self._on_backend_progress()

    def _check_quiesced(self, t: Transfer) -> None:
        try:
            ok = self._backend.quiesced(t.backend_handle)
        except Exception:
            ok = False
        if ok:
            t.set_quiesced()
            self._unquiesced.pop(t.id, None)

    def progress(self) -> list[Transfer]:
        """Poll every pending transfer; return those that became DONE or FAILED, in
        completion order, each at most once (T1); silent ones fail by their deadline (T2).

        Every finished transfer nobody has seen end is returned (exactly once). One whose
        terminal state a ``status()``/``wait()`` call already returned is returned only
        while the caller still holds its ``Transfer`` (or among the latest
        ``AgentConfig.progress_window`` such ones): the agent keeps no finished transfer
        the caller has seen and let go, so waiting alone never accumulates memory."""
        now = time.monotonic()
        with self._lock:
            if not self._closed:
                for t in list(self._pending.values()):
                    self._poll_one(t, now)
                for t in list(self._unquiesced.values()):
                    self._check_quiesced(t)
            finished = self._finished.drain()
        if not finished and self._pending:
            # a caller spinning on progress() lets the backend's threads run
            self._fast_idle_progress = note_pending_poll(now, self._idle_progress_at, self._fast_idle_progress)
            self._idle_progress_at = time.monotonic()
        return finished

    def pending(self) -> int:
        return len(self._pending)

    # -- notifications --------------------------------------------------------
    def notifications(self) -> list[Notification]:
        """Messages peers attached to transfers or sent standalone, oldest first; drains."""
        with self._lock:
            self._check_open()
            with self._backend_call("failed to deliver notifications", NotificationError):
                raw = self._backend.notifications()
            msgs = [Notification(p, bytes(m)) for p, m in raw]
            self._stats["notifications_received"] += len(msgs)
            return msgs

    def send_notification(self, peer: Peer, payload: bytes) -> None:
        """Send ``payload`` to ``peer`` without data.

        Raises only typed errors: :class:`~kvtransport.errors.InvalidSegmentsError` (not
        bytes), :class:`~kvtransport.errors.UnknownPeerError` (not connected),
        :class:`~kvtransport.errors.AgentClosedError`,
        :class:`~kvtransport.errors.UnsupportedOperationError` (the backend has no
        standalone notifications) and :class:`~kvtransport.errors.NotificationError`
        (the backend could not deliver it: peer gone, link down, queue full)."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise InvalidSegmentsError(f"notification payload must be bytes, got {type(payload).__name__}")
        with self._lock:
            self._check_open()
            if self._peers.get(peer.name) is not peer:
                raise UnknownPeerError(f"peer {peer.name!r} is not connected to {self.name!r}")
            try:
                self._backend.send_notification(peer._handle, bytes(payload))
            except NotImplementedError as exc:
                raise UnsupportedOperationError(
                    f"backend {self.backend_name!r} cannot send standalone notifications ({exc}); "
                    "attach the message to a transfer with notify=, or use a backend that "
                    "sends them (loopback, ucx)") from exc
            except Exception as exc:  # the backend's own NotificationError gets the fix added
                detail = str(exc) if isinstance(exc, KVTransportError) else f"{type(exc).__name__}: {exc}"
                raise NotificationError(
                    f"notification to peer {peer.name!r} not delivered by backend "
                    f"{self.backend_name!r}: {detail}. The peer may have exited or been "
                    "restarted: check peer_alive(), reconnect with its new metadata, then "
                    "retry") from exc

    # -- lifetime -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            s: dict[str, Any] = dict(self._stats)
            s["pending"] = len(self._pending)
            s["unquiesced"] = len(self._unquiesced)
            s["peers"] = len(self._peers)
            s["regions"] = len(self._regions)
            if self._latencies:
                lat = np.fromiter(self._latencies, dtype=float)
                for p in (50, 90, 99):
                    s[f"latency_p{p}_s"] = float(np.percentile(lat, p))
            if self.faults is not None:
                s["faults_injected"] = dict(self.faults.plan.injected)
            return s

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "backend": self.backend_name, **self._backend.describe()}

    def close(self) -> None:
        """Fail what is pending, release the backend. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for t in list(self._pending.values()):
                self._fail(t, f"agent {self.name!r} closed")
            self._closed = True
            self._peers.clear()
            self._backend.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, backend={self.backend_name!r}, closed={self._closed})"


class _TransferOwner:
    """The agent's side of :class:`~kvtransport.transfer.TransferOwner`: all a Transfer
    may ask of its agent. Kept apart from :class:`Agent` so the agent's public API does
    not grow per-transfer plumbing."""

    __slots__ = ("_agent",)

    def __init__(self, agent: Agent):
        self._agent = agent

    def poll_transfer(self, t: Transfer) -> TransferStatus:
        a = self._agent
        with a._lock:
            if t.id in a._pending:
                a._poll_one(t, time.monotonic())
            elif t.id in a._unquiesced:
                a._check_quiesced(t)
            st = t.last_status
            if st.state is not State.PENDING:  # the caller sees it end: progress() need not hold it
                a._finished.seen(t)
            return st

    def progress_token(self) -> int:
        return self._agent._progress_gen

    def wait_for_progress(self, token: int, timeout: float) -> None:
        cond = self._agent._progress_cond
        with cond:
            if self._agent._progress_gen == token:
                cond.wait(timeout)

    def release_transfer(self, t: Transfer) -> None:
        a = self._agent
        with a._lock:
            if t.released or t.id in a._pending or t.id in a._unquiesced or a._closed:
                return
            if t.mark_released() and t.backend_handle is not None:
                try:
                    a._backend.release(t.backend_handle)
                except Exception:
                    pass


_CORE_OPTIONS = {"name", "default_timeout_s", "max_metadata_bytes", "layout", "faults", "config",
                 "latency_window", "progress_window"}


def open_agent(backend: str = "loopback", *, name: str | None = None,
               config: AgentConfig | None = None, **options: Any) -> Agent:
    """Open an agent on the backend registered under ``backend``.

    Core settings come from ``config`` or the keywords ``default_timeout_s``,
    ``max_metadata_bytes``, ``layout``, ``faults``, ``latency_window``,
    ``progress_window`` (see :class:`AgentConfig`); every other keyword is a backend
    option, passed to the backend unchanged.
    """
    cfg = dataclasses.replace(config) if config is not None else AgentConfig()
    core = {k: options.pop(k) for k in list(options) if k in _CORE_OPTIONS}
    for k, v in core.items():
        setattr(cfg, k, plan_from_options(v) if k == "faults" else v)
    if name is not None:
        cfg.name = name
    if cfg.name is None:
        cfg.name = f"{backend}-{secrets.token_hex(4)}"
    _check_timeout(cfg.default_timeout_s)
    _check_core_config(cfg)
    cls = load_backend_class(backend)
    av = probe_class(cls)
    if not av.usable:
        raise BackendUnavailableError(backend, av.reason, av.install_hint)
    try:
        impl: Backend = cls(cfg.name, options)
    except KVTransportError:
        raise
    except Exception as exc:  # a library's own error (e.g. UCX refusing a device): typed, named
        raise BackendUnavailableError(
            backend, f"it failed to start with options {sorted(options)}: {type(exc).__name__}: {exc}",
            "check the options that name devices or transports on this host; `kvtransport backends` "
            "says what this host supports") from exc
    try:
        if cfg.faults is not None:
            impl = FaultInjectingBackend(impl, cfg.faults)
        return Agent(impl, cfg)
    except BaseException:
        try:
            impl.close()  # its threads, sockets and files must not outlive a failed open
        except Exception:  # the open's own error is the one to report
            pass
        raise


def _check_core_config(cfg: AgentConfig) -> None:
    """Typed errors for bad core settings, before a backend (threads, sockets) exists."""
    if not isinstance(cfg.name, str) or not cfg.name:
        raise BackendOptionError(f"name must be a non-empty string, got {cfg.name!r}")
    for key, low in (("latency_window", 1), ("progress_window", 0), ("max_metadata_bytes", 1)):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise BackendOptionError(f"core option {key} must be an integer >= {low}, got {v!r}")
    if cfg.layout is not None and not isinstance(cfg.layout, Mapping):
        raise BackendOptionError(f"core option layout must be a mapping of layout facts or None, "
                                 f"got {type(cfg.layout).__name__}")
    if cfg.faults is not None and not isinstance(cfg.faults, FaultPlan):
        raise BackendOptionError(f"core option faults must be a FaultPlan, got {type(cfg.faults).__name__}")
