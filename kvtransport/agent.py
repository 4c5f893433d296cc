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
:class:`~kvtransport.transfer.TransferOwner` protocol, and the agent changes a Transfer
only through its owner side.

The agent is a facade over parts with one job each: :mod:`.preparation` (validation and
merging before anything is posted), :mod:`.inflight` (posted transfers: polling,
deadlines, quiescence, exactly-once results), :mod:`.peer` (a connected peer and the
checks its metadata passes), :mod:`.regions` (registered memory as arrays for range checks),
:mod:`.agent_config` (core settings apart from backend options).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import metadata as md_mod
from .agent_config import AgentConfig, core_config
from .errors import (
    AgentClosedError,
    BackendUnavailableError,
    IncompatiblePeerError,
    InvalidSegmentsError,
    KVTransportError,
    NotificationError,
    PeerMetadataError,
    UnknownPeerError,
    UnregisteredMemoryError,
    UnsupportedMemoryKindError,
    UnsupportedOperationError,
)
from .faults import FaultInjectingBackend
from .inflight import InFlightTransfers
from .memory import MemoryRegion, RemoteMemoryRegion, describe_buffer
from .peer import Peer, check_compatible, check_peer
from .preparation import TransferPreparer, check_timeout
from .progress_fd import ProgressFd
from .regions import LocalRegions
from .registry import load_backend_class, probe_class
from .segments import Segments
from .spi import Backend, LocalRegion, Op, RemoteRegion
from .transfer import PreparedTransfer, Transfer

__all__ = ["AgentConfig", "Agent", "Peer", "Notification", "PreparedTransfer", "open_agent"]


@dataclass(frozen=True)
class Notification:
    peer: str
    payload: bytes


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
        self._progress_fds: set[ProgressFd] = set()  # open_progress_fd; under _progress_cond
        b: Any = backend
        while b is not None:  # the backend, and the real one under a fault injector
            b.progress_callback = self._on_backend_progress
            b = getattr(b, "inner", None)
        self._closed = False
        self._regions = LocalRegions()
        self._peers: dict[str, Peer] = {}
        self._stats = dict(
            transfers_posted=0, transfers_done=0, transfers_failed=0, transfers_timed_out=0,
            bytes_read=0, bytes_written=0, segments_posted=0, segments_merged=0,
            notifications_received=0, peers_refused=0,
        )
        self._transfers = InFlightTransfers(
            backend, self._lock, self._stats, progress_window=config.progress_window,
            latency_window=config.latency_window, wake=self._on_backend_progress,
            progress_token=lambda: self._progress_gen, wait_for_progress=self._wait_for_progress)
        self._preparer = TransferPreparer(backend, self.name, self.instance, self._regions, self._peers,
                                          lambda: self.config.default_timeout_s, self._check_open)

    # -- properties -----------------------------------------------------------
    @property
    def faults(self) -> FaultInjectingBackend | None:
        """The fault injector when opened with ``faults=`` (its plan and counts), else None."""
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
        return self._regions.regions()

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
        self._preparer.check_memory_kind(mkind, "register")
        with self._lock:
            self._check_open()
            rid = self._regions.next_id()
            region = MemoryRegion(rid, addr, length, mkind, device, owner)
            with self._backend_call(f"could not register {length} bytes of {mkind} memory at {addr:#x}"):
                blob = self._backend.register(LocalRegion(rid, addr, length, mkind, device))
            self._regions.add(region, bytes(blob))
            return region

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            self._check_open()
            if not isinstance(region, MemoryRegion):
                raise UnregisteredMemoryError(
                    f"deregister() takes a MemoryRegion that register() returned, got {type(region).__name__}")
            mine = self._regions.get(region.id)
            if mine is None:
                raise UnregisteredMemoryError(f"region {region.id} is not registered on {self.name!r}")
            if (mine.addr, mine.length, mine.kind) != (region.addr, region.length, region.kind):
                raise UnregisteredMemoryError(
                    f"region {region.id} ({region.length} bytes at {region.addr:#x}) was not registered "
                    f"by {self.name!r} (its region {region.id} is {mine.length} bytes at "
                    f"{mine.addr:#x}); deregister it on the agent that registered it")
            busy = self._transfers.using_region(region.id)
            if busy:
                raise KVTransportError(
                    f"region {region.id} is in use by transfers {busy[:8]} (pending or not yet "
                    "quiesced); wait for them before deregistering"
                )
            # Out of the core first, whatever the backend says: no new transfer may use it.
            self._regions.remove(region.id)
            try:
                self._backend.deregister(LocalRegion(region.id, region.addr, region.length, region.kind,
                                                     region.device))
            except Exception as exc:
                raise KVTransportError(
                    f"backend {self.backend_name!r} failed to deregister region {region.id}: "
                    f"{type(exc).__name__}: {exc}; the core no longer uses it, but the backend may "
                    "still hold the memory: keep the buffer alive until the agent is closed") from exc

    # -- peers ----------------------------------------------------------------
    def metadata(self) -> bytes:
        """Versioned blob a peer passes to its ``connect``."""
        with self._lock:
            self._check_open()
            regions = [
                md_mod.RegionDesc(r.id, r.addr, r.length, r.kind, blob)
                for r, blob in self._regions.exported()
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
                check_compatible(md, self.backend_name, self._backend.version, self.config.layout)
            except (PeerMetadataError, IncompatiblePeerError):
                self._stats["peers_refused"] += 1
                raise
            if md.agent == self.name and md.instance == self.instance:
                raise IncompatiblePeerError(
                    f"agent {self.name!r} cannot connect to itself; open a second agent"
                )
            for r in md.regions:  # a peer's device region must not reach a CPU-only data path
                try:
                    self._preparer.check_memory_kind(r.kind, f"connect to peer {md.agent!r} exporting",
                                                     remote=True)
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

    def disconnect(self, peer: Peer) -> None:
        check_peer(peer)
        with self._lock:
            self._check_open()
            if self._peers.get(peer.name) is not peer:
                raise UnknownPeerError(f"peer {peer.name!r} is not connected to {self.name!r}")
            self._drop_peer(peer, f"peer {peer.name!r} disconnected")

    def peer_alive(self, peer: Peer) -> bool | None:
        """True: the peer's process runs; False: it is known gone, so no transfer it
        posted into our memory can land any more; None: the backend cannot tell.
        Works for a replaced or disconnected ``Peer`` too (the old process)."""
        check_peer(peer)
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
            self._transfers.fail_peer(peer.name, reason)

    # -- data path ------------------------------------------------------------
    def read(self, peer: Peer, local: Segments, remote: Segments, *, notify: bytes | None = None,
             timeout: float | None = None) -> Transfer:
        """Copy ``remote`` (on ``peer``) into ``local``. ``notify`` reaches the peer after
        the data has moved."""
        with self._lock:
            return self._post_prepared(self._preparer.prepare(Op.READ, peer, local, remote, notify, timeout))

    def write(self, peer: Peer, local: Segments, remote: Segments, *, notify: bytes | None = None,
              timeout: float | None = None) -> Transfer:
        """Copy ``local`` into ``remote`` (on ``peer``); ``notify`` reaches the peer after
        the data landed."""
        with self._lock:
            return self._post_prepared(self._preparer.prepare(Op.WRITE, peer, local, remote, notify, timeout))

    def prepare(self, op: Op, peer: Peer, local: Segments, remote: Segments, *,
                notify: bytes | None = None, timeout: float | None = None) -> PreparedTransfer:
        """Validate (T4) and merge a transfer once, without posting it; post it with
        :meth:`post` as often as needed. Raises the typed errors ``read``/``write``
        raise; moves nothing. ``notify``/``timeout`` are the defaults of each post."""
        with self._lock:
            return self._preparer.prepare(op, peer, local, remote, notify, timeout)

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
            self._preparer.check(prepared)
            return self._post_prepared(prepared, notify, timeout)

    def _post_prepared(self, p: PreparedTransfer, notify: bytes | None = None,
                       timeout: float | None = None) -> Transfer:
        """Post a validated preparation (caller holds the lock and checked it)."""
        notify = p.notify if notify is None else self._preparer.check_notify(notify)
        timeout_s = p.timeout_s if timeout is None else check_timeout(timeout)
        return self._transfers.post(p, notify, timeout_s)

    # -- progress -------------------------------------------------------------
    def _on_backend_progress(self) -> None:
        with self._progress_cond:
            self._progress_gen += 1
            self._progress_cond.notify_all()
            for fd in self._progress_fds:
                fd.signal()

    def open_progress_fd(self) -> ProgressFd:
        """A file descriptor made readable whenever a transfer of this agent may have
        changed state, to wait on transfers and sockets in one poll (see
        :mod:`kvtransport.progress_fd`); the caller closes it."""
        fd = ProgressFd(self._drop_progress_fd)
        with self._progress_cond:
            self._progress_fds.add(fd)
        return fd

    def _drop_progress_fd(self, fd: ProgressFd) -> None:
        with self._progress_cond:
            self._progress_fds.discard(fd)

    def _wait_for_progress(self, token: int, timeout: float) -> None:
        """Sleep until a backend signals progress after ``token``, or ``timeout`` s."""
        with self._progress_cond:
            if self._progress_gen == token:
                self._progress_cond.wait(timeout)

    def progress(self) -> list[Transfer]:
        """Poll every pending transfer; return those that became DONE or FAILED, in
        completion order, each at most once (T1); silent ones fail by their deadline (T2).

        Every finished transfer nobody has seen end is returned (exactly once). One whose
        terminal state a ``status()``/``wait()`` call already returned is returned only
        while the caller still holds its ``Transfer`` (or among the latest
        ``AgentConfig.progress_window`` such ones): the agent keeps no finished transfer
        the caller has seen and let go, so waiting alone never accumulates memory."""
        return self._transfers.progress()

    def pending(self) -> int:
        return len(self._transfers.pending)

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
            s["pending"] = len(self._transfers.pending)
            s["unquiesced"] = len(self._transfers.unquiesced)
            s["peers"] = len(self._peers)
            s["regions"] = len(self._regions)
            if self._transfers.latencies:
                lat = np.fromiter(self._transfers.latencies, dtype=float)
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
            self._transfers.close(f"agent {self.name!r} closed")
            self._closed = True
            self._peers.clear()
            self._backend.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, backend={self.backend_name!r}, closed={self._closed})"


def open_agent(backend: str = "loopback", *, name: str | None = None,
               config: AgentConfig | None = None, **options: Any) -> Agent:
    """Open an agent on the backend registered under ``backend``.

    Core settings come from ``config`` or the keywords ``default_timeout_s``,
    ``max_metadata_bytes``, ``layout``, ``faults``, ``latency_window``,
    ``progress_window`` (see :class:`AgentConfig`); every other keyword is a backend
    option, passed to the backend unchanged.
    """
    cfg = core_config(backend, name, config, options)
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
