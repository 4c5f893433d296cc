"""The ``ucx`` backend: one-sided RMA through UCX's ucp API (bound in ``_ucp``).

Data path of one transfer (``post``):

1. one ``ucp_put_nbx`` / ``ucp_get_nbx`` per merged segment, straight from the numpy
   arrays of the :class:`~kvtransport.spi.PostRequest` (the core already merged contiguous
   runs); the per-op requests are released at once (``ucp_request_free``), UCX keeps them
   until they complete;
2. one ``ucp_ep_flush_nbx`` on the peer's endpoint: it completes when every RMA issued
   before it completed *at the target* — the single request the transfer tracks;
3. after the flush, the notification (if any) as an active message, so a peer can never
   observe a WRITE's notification before its data landed.

The remote side does no work per transfer: with cma (same host) the initiator's kernel
copies, with RDMA the NIC does; over tcp UCX emulates RMA with active messages served by
the target's progress thread (still no application call on the target).

Peer failure: endpoints use ``UCP_ERR_HANDLING_MODE_PEER`` when the transports support it
(tcp, cma, verbs) so UCX reports a dead peer and fails its requests. The shared-memory
message transports (sysv, posix) do not; for them (``tls="shm"``) a same-host peer is
watched by pid + start time (``_liveness``). A cross-host peer on a transport without peer
failure support is only caught by the core's deadline.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from ctypes import byref, c_size_t, c_void_p
from typing import Any

import msgspec
import numpy as np

from kvtransport.errors import BackendOptionError, KVTransportError, PeerMetadataError
from kvtransport.spi import (
    Availability,
    Backend,
    Capabilities,
    LocalRegion,
    Op,
    PollResult,
    PostRequest,
    RemoteRegion,
    Scope,
)

from . import _ucp as U
from ._liveness import ProcessIdentity
from ._options import UcxOptions, parse_options
from ._worker import AM_NOTIFY, Lane, UcpWorker

_INSTALL_HINT = "pip install 'kvtransport[ucx]'  (installs libucx-cu12)"
_MAX_PTR = (1 << 64) + U.UCS_ERR_LAST


class _Export(msgspec.Struct, frozen=True):
    """Agent-level blob: the UCP worker address plus who we are (for liveness checks)."""

    v: int
    address: bytes
    err_mode: str
    pid: int
    start_time: int
    boot_id: str
    pid_ns: str
    hostname: str
    #: Addresses of all our lanes (address == lane_addresses[0]); empty from older peers.
    lane_addresses: list[bytes] = []


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(_Export)


_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _cut(parts: _Arrays, nbytes: int) -> tuple[_Arrays, _Arrays]:
    """Split (local addr, remote addr, length, local region, remote region) after ``nbytes``
    bytes (0 < nbytes < total), cutting at most the one segment that straddles the point."""
    la, ra, ln, lr, rr = parts
    cum = np.cumsum(ln)
    i = int(np.searchsorted(cum, nbytes))  # first segment ending at or after the point
    within = nbytes - (int(cum[i]) - int(ln[i]))  # its bytes that belong to the head, >= 1
    hl = ln[: i + 1].copy()
    hl[i] = within
    head = (la[: i + 1], ra[: i + 1], hl, lr[: i + 1], rr[: i + 1])
    if within == int(ln[i]):
        return head, (la[i + 1 :], ra[i + 1 :], ln[i + 1 :], lr[i + 1 :], rr[i + 1 :])
    tla, tra, tln = la[i:].copy(), ra[i:].copy(), ln[i:].copy()
    tla[0] += within
    tra[0] += within
    tln[0] -= within
    return head, (tla, tra, tln, lr[i:], rr[i:])


class _Conn:
    """Our endpoint to one peer, its unpacked remote keys, and its liveness."""

    def __init__(self, key: int, name: str, exp: _Export, regions: Sequence[RemoteRegion],
                 ident: ProcessIdentity, same_host: bool) -> None:
        self.key = key
        self.name = name
        self.exp = exp
        self.regions = list(regions)
        self.ident = ident
        self.same_host = same_host
        #: Per lane: our endpoint to the peer, and the remote keys unpacked on it (in
        #: ``regions`` order). Empty while no endpoint is open.
        self.eps: list[int] = []
        self.lane_rkeys: list[list[int]] = []
        self.rk_ids = np.zeros(0, np.int64)  # region ids, sorted
        self.rk_ptrs: list[np.ndarray] = []  # per lane: rkeys in rk_ids order
        self.rk_by_id: list[dict[int, int]] = []  # per lane: region id -> rkey
        #: Whether to check the peer's process after each flush: same host, other process
        #: (an agent of our own process cannot outlive us).
        self.watch_process = same_host and ident.pid != os.getpid()
        self.failed: str | None = None  # set once the peer is known failed
        self.dead = False  # the peer process is confirmed gone (nothing more can land)
        self.broken = False  # our endpoint was closed: reopen before the next post
        self.forced = False  # ... and it was a forced close: every outstanding request ended
        self.xfers: set[_Xfer] = set()


class _Xfer:
    """Backend handle of one posted transfer."""

    __slots__ = ("tid", "conn", "op", "notify", "stage", "flush", "am_req", "am_bufs",
                 "reason", "error", "cancel_at")

    def __init__(self, tid: int, conn: _Conn, op: Op, notify: bytes | None) -> None:
        self.tid = tid
        self.conn = conn
        self.op = op
        self.notify = notify
        self.stage = "rma"  # rma -> notify -> done | failed
        #: One outstanding flush request per lane the transfer used: (lane, request).
        self.flush: list[tuple[Lane, int]] = []
        self.am_req: int | None = None
        self.am_bufs: Any = None
        self.reason = ""
        self.error: str | None = None  # an RMA op failed to post; fail once flushed
        self.cancel_at: float | None = None

    @property
    def quiesced(self) -> bool:
        """No byte of this transfer can land any more."""
        return not self.flush or self.conn.dead or self.conn.forced


class UcxBackend(Backend):
    name = "ucx"
    version = "1"
    capabilities = Capabilities(
        read=True,
        write=True,
        notify=True,
        memory_kinds=frozenset({"cpu"}),
        scopes=frozenset({Scope.SAME_PROCESS, Scope.SAME_HOST, Scope.CROSS_HOST}),
        detects_peer_failure=True,
    )
    #: tcp: cross-host path; shm: sysv/posix + cma without UCX peer-error handling (pid
    #: liveness instead); cma+tcp: cma data with UCX peer-error handling over tcp.
    conformance_options = ({"tls": "tcp"}, {"tls": "shm"}, {"tls": "cma+tcp"})

    @classmethod
    def probe(cls) -> Availability:
        try:
            lib = U.lib()
            major, minor = (int(x) for x in lib.version().split(".")[:2])
        except Exception as exc:
            return Availability(False, f"cannot load libucp: {exc}", _INSTALL_HINT)
        if (major, minor) < (1, 11):
            return Availability(False, f"UCX {lib.version()} is too old (need >= 1.11)", _INSTALL_HINT)
        return Availability(True)

    def __init__(self, agent_name: str, options: Mapping[str, Any]) -> None:
        super().__init__(agent_name, options)
        self.opts: UcxOptions = parse_options(options)
        self._ident = ProcessIdentity.current()
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._conns: dict[int, _Conn] = {}  # key -> conn (key is the error-handler arg)
        self._by_name: dict[str, _Conn] = {}
        self._active: set[_Xfer] = set()
        self._memh: dict[int, int] = {}
        self._rparams: dict[int, U.ucp_request_param_t] = {}
        self._sends: list[tuple[int, Any]] = []  # standalone AM requests + their buffers
        #: endpoints being closed: (lane, close request or None, rkeys to destroy after)
        self._closing: list[tuple[Lane, int | None, list[int]]] = []
        self._keys = itertools.count(1)
        self._next_liveness = 0.0
        self._closed = False
        try:
            self._w = self._make_worker(agent_name)
        except U.UcxConfigError as exc:
            raise BackendOptionError(
                f"ucx backend: {exc}; see `ucx_info -c` for the settings this UCX accepts"
            ) from None
        self._ucp = self._w.ucp
        self._lanes = self._w.lanes
        self._lane_bytes = [0] * len(self._lanes)  # bytes posted per lane (describe())
        self._param = U.ucp_request_param_t()  # no callback: requests are polled
        self._am_param = U.ucp_request_param_t()
        self._am_param.op_attr_mask = U.UCP_OP_ATTR_FIELD_FLAGS
        self._am_param.flags = U.UCP_AM_SEND_FLAG_EAGER | U.UCP_AM_SEND_FLAG_COPY_HEADER
        self._am_header = agent_name.encode()

    def _make_worker(self, agent_name: str) -> UcpWorker:
        return UcpWorker(
            agent_name,
            self.opts.ucx_settings(),
            optional_config=self.opts.optional_ucx_settings(),
            lanes=self.opts.lanes,
            on_notify=lambda sender, payload: self._inbox.append((sender, payload)),
            after_progress=self._after_progress,
            busy_poll=self.opts.progress == "busy",
            idle_timeout_s=min(0.25, self.opts.liveness_interval_s),
        )

    # -- memory ---------------------------------------------------------------------------
    def register(self, region: LocalRegion) -> bytes:
        p = U.ucp_mem_map_params_t()
        p.field_mask = (U.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | U.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                        | U.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
        p.address = region.addr
        p.length = region.length
        p.memory_type = U.UCS_MEMORY_TYPE_HOST
        memh, buf, size = c_void_p(), c_void_p(), c_size_t()
        with self._w.lock:
            U.check(self._ucp.ucp_mem_map(self._w.context, byref(p), byref(memh)), "ucp_mem_map")
            st = self._ucp.ucp_rkey_pack(self._w.context, memh, byref(buf), byref(size))
            if st != U.UCS_OK:
                self._ucp.ucp_mem_unmap(self._w.context, memh)
                U.check(st, "ucp_rkey_pack")
            blob = ctypes.string_at(buf, size.value)
            self._ucp.ucp_rkey_buffer_release(buf)
            self._memh[region.id] = memh.value
            # Per-region operation parameters carrying the memory handle, so UCX skips the
            # registration-cache lookup of the local buffer on every put/get.
            rp = U.ucp_request_param_t()
            rp.op_attr_mask = U.UCP_OP_ATTR_FIELD_MEMH
            rp.memh = memh.value
            self._rparams[region.id] = rp
        return blob

    def deregister(self, region: LocalRegion) -> None:
        with self._w.lock:
            self._rparams.pop(region.id, None)
            memh = self._memh.pop(region.id, None)
            if memh is not None:
                U.check(self._ucp.ucp_mem_unmap(self._w.context, memh), "ucp_mem_unmap")

    # -- peers ----------------------------------------------------------------------------
    def export(self) -> bytes:
        i = self._ident
        return _ENC.encode(_Export(1, self._w.address, self.opts.err_mode, i.pid, i.start_time,
                                   i.boot_id, i.pid_ns, i.hostname, list(self._w.addresses)))

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> _Conn:
        try:
            exp = _DEC.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PeerMetadataError(f"ucx blob of peer {peer_name!r} is malformed: {exc}") from None
        if exp.v != 1:
            raise PeerMetadataError(f"ucx blob of peer {peer_name!r} has version {exp.v}, expected 1")
        ident = ProcessIdentity(exp.pid, exp.start_time, exp.boot_id, exp.pid_ns, exp.hostname)
        conn = _Conn(next(self._keys), peer_name, exp, regions, ident, self._ident.same_host_as(ident))
        with self._w.lock:
            old = self._by_name.get(peer_name)
            if old is not None:
                self._drop(old, f"connection to {peer_name!r} replaced by a new connect")
            self._open(conn)
            self._conns[conn.key] = conn
            self._by_name[peer_name] = conn
        self._w.wake()
        return conn

    def _open(self, conn: _Conn) -> None:
        """Create an endpoint on every lane and unpack the peer's remote keys on each (lock held)."""
        force = self.opts.err_mode == "peer"
        eps: list[int] = []
        lane_rkeys: list[list[int]] = []
        try:
            for lane in self._lanes:
                with lane.lock:
                    eps.append(self._create_ep(lane, conn))
                    rkeys: list[int] = []
                    lane_rkeys.append(rkeys)
                    for r in conn.regions:
                        rk = c_void_p()
                        buf = ctypes.create_string_buffer(r.blob, len(r.blob))
                        st = self._ucp.ucp_ep_rkey_unpack(eps[-1], buf, byref(rk))
                        if st != U.UCS_OK:
                            raise PeerMetadataError(
                                f"remote key of region {r.id} of peer {conn.name!r} cannot be unpacked: "
                                f"{U.lib().status_string(st)} (peer built with incompatible transports?)"
                            )
                        rkeys.append(rk.value)
        except Exception:
            for lane, ep in zip(self._lanes, eps):
                self._close_ep(lane, ep, lane_rkeys[lane.index] if lane.index < len(lane_rkeys) else [], force)
            raise
        order = np.argsort(np.array([r.id for r in conn.regions], np.int64), kind="stable")
        conn.eps, conn.lane_rkeys = eps, lane_rkeys
        conn.rk_ids = np.array([conn.regions[i].id for i in order], np.int64)
        conn.rk_ptrs = [np.array([rks[i] for i in order], np.uint64) for rks in lane_rkeys]
        conn.rk_by_id = [{r.id: rk for r, rk in zip(conn.regions, rks)} for rks in lane_rkeys]
        conn.broken = conn.forced = False

    def _create_ep(self, lane: Lane, conn: _Conn) -> int:
        """One endpoint from our ``lane`` to the peer's lane of the same index (modulo its
        lane count; lane 0 for a peer that exports one address) (lane lock held). Lane 0
        endpoints carry the notifications, so they always reach the peer's lane 0."""
        theirs = conn.exp.lane_addresses or [conn.exp.address]
        target = theirs[lane.index % len(theirs)]
        addr = ctypes.create_string_buffer(target, len(target))
        p = U.ucp_ep_params_t()
        p.field_mask = U.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | U.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        p.address = ctypes.addressof(addr)
        p.err_mode = U.UCP_ERR_HANDLING_MODE_PEER if self.opts.err_mode == "peer" else U.UCP_ERR_HANDLING_MODE_NONE
        if self.opts.err_mode == "peer":
            p.field_mask |= U.UCP_EP_PARAM_FIELD_ERR_HANDLER
            p.err_handler.cb = self._w.err_cb_ptr
            p.err_handler.arg = conn.key
        ep = c_void_p()
        st = self._ucp.ucp_ep_create(lane.worker, byref(p), byref(ep))
        if st != U.UCS_OK:
            raise PeerMetadataError(
                f"cannot reach peer {conn.name!r} over UCX (tls={self.opts.tls or 'default'}): "
                f"{U.lib().status_string(st)}; both agents need a common transport"
            )
        return ep.value

    def _close_ep(self, lane: Lane, ep: int | None, rkeys: list[int], force: bool) -> None:
        """Close an endpoint; its remote keys are destroyed once the close completed."""
        req = None
        if ep is not None:
            p = U.ucp_request_param_t()
            p.op_attr_mask = U.UCP_OP_ATTR_FIELD_FLAGS
            p.flags = U.UCP_EP_CLOSE_FLAG_FORCE if force else 0
            with lane.lock:
                r = self._ucp.ucp_ep_close_nbx(ep, byref(p))
            req = r if U.ptr_status(r) == U.UCS_INPROGRESS else None
        self._closing.append((lane, req, list(rkeys)))
        self._w.wake()

    def _shut(self, conn: _Conn, force: bool) -> None:
        """Close the connection's endpoints on every lane (lock held); reopened at the next post."""
        for lane, ep, rkeys in zip(self._lanes, conn.eps, conn.lane_rkeys):
            self._close_ep(lane, ep, rkeys, force)
        conn.eps, conn.lane_rkeys, conn.rk_ptrs, conn.rk_by_id = [], [], [], []
        conn.broken, conn.forced = True, force

    def _drop(self, conn: _Conn, reason: str) -> None:
        """Forget a connection (lock held): fail its transfers, close its endpoints."""
        self._conns.pop(conn.key, None)
        if self._by_name.get(conn.name) is conn:
            del self._by_name[conn.name]
        conn.failed = conn.failed or reason
        if conn.eps and not conn.broken:
            self._shut(conn, force=self.opts.err_mode == "peer")
        for x in list(conn.xfers):
            self._fail(x, reason)

    def peer_alive(self, peer: _Conn) -> bool | None:
        """Same host: pid + start time; across hosts only UCX's own failure report."""
        if peer.dead or (peer.same_host and not peer.ident.is_alive()):
            return False
        return True if peer.same_host else None

    def disconnect(self, peer: _Conn) -> None:
        with self._w.lock:
            self._drop(peer, f"peer {peer.name!r} disconnected")

    # -- data path ------------------------------------------------------------------------
    def post(self, req: PostRequest) -> _Xfer:
        conn: _Conn = req.peer
        if conn.failed:
            raise KVTransportError(conn.failed)
        x = _Xfer(req.transfer_id, conn, req.op, req.notify)
        with self._w.lock:
            if self._closed:
                raise KVTransportError("ucx backend is closed")
            if conn.broken:
                self._open(conn)  # our endpoints were force-closed after a stuck cancel
            parts = self._split(req)
            keys = [self._remote_keys(conn, k, rr) for k, _, _, _, _, rr in parts]  # refuse before posting
            conn.xfers.add(x)
            self._active.add(x)
            # Lanes >= 1 first, then wake the progress thread: it copies their share while
            # this thread posts and copies lane 0's (inline, below).
            for (k, la, ra, ln, lr, _), rks in reversed(list(zip(parts, keys))):
                self._post_lane(x, self._lanes[k], la, ra, ln, lr, rks)
                self._lane_bytes[k] += int(ln.sum())
                if k > 0:
                    self._w.wake(k)
            if self.opts.inline_progress_s > 0 and x.flush and x.flush[-1][0].index == 0:
                self._progress_inline(x.flush[-1][1], time.perf_counter() + self.opts.inline_progress_s)
            self._advance(x)
            # Wake lane 0's thread only if it has something to finish: a transfer that
            # completed inline (the common cma case) must not pay a thread hand-off, and
            # the other lanes' threads are awake already and advance x when they are done.
            wake = (any(lane.index == 0 for lane, _ in x.flush) or self._sends or self._closing
                    or len(self._active) > 1)
        if wake:
            self._w.wake()
        return x

    def _post_lane(self, x: _Xfer, lane: Lane, la: np.ndarray, ra: np.ndarray, ln: np.ndarray,
                   lr: np.ndarray, rks: Any) -> None:
        """Post one lane's share of a transfer, then its flush (backend lock held)."""
        if x.error:
            return
        conn = x.conn
        fn = self._ucp.ucp_put_nbx if x.op is Op.WRITE else self._ucp.ucp_get_nbx
        free = self._ucp.ucp_request_free
        ep, pp = conn.eps[lane.index], byref(self._param)
        pps = self._local_params(lr, pp)
        with lane.lock:
            # The one Python loop of the data path: one foreign call per merged segment.
            for a, b, n, rk, lp in zip(la.tolist(), ra.tolist(), ln.tolist(), rks, pps):
                r = fn(ep, a, n, b, rk, lp)
                if r:
                    if r >= _MAX_PTR:
                        x.error = (f"{'put' if x.op is Op.WRITE else 'get'} to peer {conn.name!r} "
                                   f"failed: {U.lib().status_string(r - (1 << 64))}")
                        break
                    free(r)
            r = self._ucp.ucp_ep_flush_nbx(ep, pp)
        st = U.ptr_status(r)
        if st == U.UCS_INPROGRESS:
            x.flush.append((lane, r))
        elif st != U.UCS_OK:
            x.error = x.error or f"flush to peer {conn.name!r} failed: {U.lib().status_string(st)}"

    def _split(self, req: PostRequest) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Share a transfer's bytes evenly across the lanes: (lane, local addresses, remote
        addresses, lengths, local regions, remote regions) per lane. Below
        ``lane_split_bytes`` everything goes to lane 0 (a hand-off to the progress thread
        costs more than it saves). At most one segment per boundary is cut in two."""
        rest = (req.local_addr, req.remote_addr, req.length, req.local_region, req.remote_region)
        n = len(self._lanes)
        total = int(req.length.sum())
        if n == 1 or total < self.opts.lane_split_bytes:
            return [(0, *rest)]
        parts = []
        for k in range(n - 1):
            share = total * (k + 1) // n - total * k // n
            head, rest = _cut(rest, share)
            parts.append((k, *head))
        parts.append((n - 1, *rest))
        return parts

    def _remote_keys(self, conn: _Conn, lane: int, regions: np.ndarray) -> Any:
        """The remote key on ``lane`` of every segment's region (an iterable as long as it)."""
        if regions.size and (regions.size == 1 or bool((regions == regions[0]).all())):
            rk = conn.rk_by_id[lane].get(int(regions[0]))  # one region: the common case
            if rk is not None:
                return itertools.repeat(rk)
        else:
            idx = np.searchsorted(conn.rk_ids, regions)
            idx = np.minimum(idx, max(len(conn.rk_ids) - 1, 0))
            if len(conn.rk_ids) and np.array_equal(conn.rk_ids[idx], regions):
                return conn.rk_ptrs[lane][idx].tolist()
        raise KVTransportError(f"peer {conn.name!r} exported no remote key for a requested region")

    def _local_params(self, regions: np.ndarray, default: Any) -> Any:
        """Per-segment request parameters carrying the local memory handle of its region."""
        if regions.size == 1 or bool((regions == regions[0]).all()):
            rp = self._rparams.get(int(regions[0]))
            return itertools.repeat(byref(rp) if rp is not None else default)
        uniq, inv = np.unique(regions, return_inverse=True)
        refs = [byref(self._rparams[u]) if u in self._rparams else default for u in uniq.tolist()]
        return [refs[i] for i in inv.tolist()]

    def _progress_inline(self, req: int, until: float) -> None:
        """Drive lane 0 on the posting thread while it has work for this transfer (lock held).

        Why: with cma the copy itself runs inside ``ucp_worker_progress``. Doing it here, on
        the thread that posted, saves the hand-off to the progress thread (pipe write, epoll
        wake-up, lock and GIL hand-overs), which cost ~0.5 ms on a 16 MiB transfer, a third
        of its copy time. It stops as soon as UCX reports nothing to do (RDMA: the NIC is
        copying; tcp: waiting on the peer), so it never spins idle, and at ``until``
        (option ``inline_progress_s``) so a large transfer does not hold the caller long;
        the progress thread finishes the rest.
        """
        lane = self._lanes[0]
        progress, worker = self._ucp.ucp_worker_progress, lane.worker
        check = self._ucp.ucp_request_check_status
        with lane.lock:
            while check(req) == U.UCS_INPROGRESS and progress(worker) and time.perf_counter() < until:
                pass

    def _advance(self, x: _Xfer) -> None:
        """Move one transfer through rma -> notify -> done (lock held)."""
        if self._w.has_ep_errors:
            self._absorb_ep_errors()
        if x.stage == "rma":
            if x.flush:
                for lane, r in x.flush:
                    if self._status(lane, r) == U.UCS_INPROGRESS:
                        if x.conn.failed:
                            self._fail(x, x.conn.failed)
                        return
                check = self._ucp.ucp_request_check_status
                for lane, r in x.flush:
                    with lane.lock:
                        st = check(r)
                        self._ucp.ucp_request_free(r)
                    if st != U.UCS_OK and not x.error:
                        x.error = f"RMA to peer {x.conn.name!r} failed: {U.lib().status_string(st)}"
                x.flush = []
            if not x.error and x.conn.watch_process:
                # UCX may complete the flush of a cma copy that failed half-way because the
                # peer died (seen without peer error handling). A peer that is exiting or
                # gone when the flush completed may have left the copy short: never DONE.
                self._check_alive(x.conn)
            if x.error or x.conn.failed:
                self._fail(x, x.error or x.conn.failed or "")
                return
            if x.notify is None:
                self._finish(x, "done")
                return
            if not x.conn.eps:
                self._fail(x, f"data moved but the endpoint to {x.conn.name!r} was closed before the notification")
                return
            buf = ctypes.create_string_buffer(x.notify, len(x.notify))
            with self._lanes[0].lock:
                r = self._ucp.ucp_am_send_nbx(x.conn.eps[0], AM_NOTIFY, self._am_header, len(self._am_header),
                                              buf, len(x.notify), byref(self._am_param))
            st = U.ptr_status(r)
            if st == U.UCS_INPROGRESS:
                x.am_req, x.am_bufs, x.stage = r, buf, "notify"
                self._w.wake()  # lane 0 must progress for the message to leave
            elif st == U.UCS_OK:
                self._finish(x, "done")
            else:
                self._fail(x, f"data moved but the notification to {x.conn.name!r} failed: "
                              f"{U.lib().status_string(st)}")
        elif x.stage == "notify":
            st = self._status(self._lanes[0], x.am_req)
            if st == U.UCS_INPROGRESS:
                if x.conn.failed:
                    self._fail(x, x.conn.failed)
                return
            with self._lanes[0].lock:
                self._ucp.ucp_request_free(x.am_req)
            x.am_req = x.am_bufs = None
            if st == U.UCS_OK:
                self._finish(x, "done")
            else:
                self._fail(x, f"data moved but the notification to {x.conn.name!r} failed: "
                              f"{U.lib().status_string(st)}")

    def _status(self, lane: Lane, req: int) -> int:
        """A request's status, or UCS_INPROGRESS while its lane is busy (a copy in progress):
        checking never waits for a copy."""
        if not lane.lock.acquire(blocking=False):
            return U.UCS_INPROGRESS
        try:
            return self._ucp.ucp_request_check_status(req)
        finally:
            lane.lock.release()

    def _finish(self, x: _Xfer, stage: str) -> None:
        x.stage = stage
        if not x.flush:
            self._active.discard(x)
            x.conn.xfers.discard(x)
        self.signal_progress()

    def _fail(self, x: _Xfer, reason: str) -> None:
        if x.stage in ("done", "failed"):
            return
        x.reason = reason
        if x.am_req is not None:
            with self._lanes[0].lock:
                self._ucp.ucp_request_free(x.am_req)  # UCX releases it when it completes
            x.am_req = None
        self._finish(x, "failed")

    def poll(self, handle: _Xfer) -> PollResult:
        with self._w.lock:
            self._advance(handle)
            if handle.stage == "done":
                return PollResult.done()
            if handle.stage == "failed":
                return PollResult.failed(handle.reason, handle.quiesced)
            return PollResult.pending()

    def cancel(self, handle: _Xfer) -> bool:
        """The core failed ``handle`` (deadline, peer failure). RMA in UCX cannot be cancelled
        one by one: we wait for the flush, and if it does not finish within
        ``cancel_grace_s`` the endpoint is force-closed (reopened at the next post)."""
        with self._w.lock:
            self._fail(handle, "cancelled")
            if handle.quiesced:
                self._release_flush(handle)
                return True
            handle.cancel_at = time.monotonic()
            self._active.add(handle)
            self._w.wake()
            return False

    def quiesced(self, handle: _Xfer) -> bool:
        with self._w.lock:
            self._check_flush(handle)
            return handle.quiesced

    def _check_flush(self, x: _Xfer) -> None:
        if x.flush:
            keep = []
            for lane, r in x.flush:
                if self._status(lane, r) == U.UCS_INPROGRESS:
                    keep.append((lane, r))
                else:
                    with lane.lock:
                        self._ucp.ucp_request_free(r)
            x.flush = keep
        if x.quiesced:
            self._release_flush(x)

    def _release_flush(self, x: _Xfer) -> None:
        for lane, r in x.flush:  # peer dead / endpoint closed: UCX frees them when they end
            with lane.lock:
                self._ucp.ucp_request_free(r)
        x.flush = []
        self._active.discard(x)
        x.conn.xfers.discard(x)

    def release(self, handle: _Xfer) -> None:
        with self._w.lock:
            if handle.stage in ("done", "failed") and handle.quiesced:
                self._release_flush(handle)

    # -- progress-thread hooks (lock held) --------------------------------------------------
    def _absorb_ep_errors(self) -> None:
        w = getattr(self, "_w", None)  # progress threads start inside UcpWorker(...)
        if w is None:
            return
        for key, status in w.take_ep_errors():
            self._on_ep_error(key, status)

    def _on_ep_error(self, key: int, status: int) -> None:
        conn = self._conns.get(key)
        if conn is None or conn.broken:
            return
        conn.failed = conn.failed or (f"peer {conn.name!r} failed: {U.lib().status_string(status)} "
                                      "(UCX endpoint error)")
        # UCX requires the user to close a failed endpoint; it is done in _after_progress.
        conn.dead = conn.dead or (conn.same_host and not conn.ident.is_alive())

    def _check_alive(self, conn: _Conn) -> None:
        if conn.same_host and not conn.dead and not conn.ident.is_alive():
            conn.dead = True
            conn.failed = conn.failed or f"peer {conn.name!r} (pid {conn.ident.pid}) exited"

    def _after_progress(self) -> None:
        now = time.monotonic()
        self._absorb_ep_errors()
        for conn in list(self._conns.values()):
            if conn.failed and not conn.broken and conn.eps and self.opts.err_mode == "peer":
                self._shut(conn, force=True)
        if now >= self._next_liveness:
            self._next_liveness = now + self.opts.liveness_interval_s
            for conn in list(self._conns.values()):
                self._check_alive(conn)
        for x in list(self._active):
            if x.stage in ("rma", "notify"):
                self._advance(x)
            else:
                self._check_flush(x)
                if (x.flush and x.cancel_at is not None
                        and now - x.cancel_at > self.opts.cancel_grace_s and self.opts.err_mode == "peer"):
                    c = x.conn
                    if c.eps and not c.broken:
                        self._shut(c, force=True)
                    self._release_flush(x)
        if self._sends:
            keep = []
            for r, buf in self._sends:
                if self._status(self._lanes[0], r) == U.UCS_INPROGRESS:
                    keep.append((r, buf))
                else:
                    with self._lanes[0].lock:
                        self._ucp.ucp_request_free(r)
            self._sends = keep
        if self._closing:
            keep_c = []
            for lane, r, rkeys in self._closing:
                with lane.lock:
                    if r is not None and self._ucp.ucp_request_check_status(r) == U.UCS_INPROGRESS:
                        keep_c.append((lane, r, rkeys))
                        continue
                    if r is not None:
                        self._ucp.ucp_request_free(r)
                    for rk in rkeys:
                        self._ucp.ucp_rkey_destroy(rk)
            self._closing = keep_c

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def send_notification(self, peer: _Conn, payload: bytes) -> None:
        if peer.failed:
            raise KVTransportError(peer.failed)
        with self._w.lock:
            if peer.broken:
                self._open(peer)
            buf = ctypes.create_string_buffer(payload, len(payload))
            with self._lanes[0].lock:
                r = self._ucp.ucp_am_send_nbx(peer.eps[0], AM_NOTIFY, self._am_header, len(self._am_header),
                                              buf, len(payload), byref(self._am_param))
            st = U.ptr_status(r)
            if st == U.UCS_INPROGRESS:
                self._sends.append((r, buf))
            elif st != U.UCS_OK:
                raise KVTransportError(f"notification to {peer.name!r} failed: {U.lib().status_string(st)}")
        self._w.wake()

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        with self._w.lock:
            self._closed = True
            for conn in list(self._conns.values()):
                self._drop(conn, f"agent {self.agent_name!r} closed")
        deadline = time.monotonic() + 2.0
        while self._closing and time.monotonic() < deadline:
            self._w.progress_once()
            time.sleep(0.001)
        with self._w.lock:
            for lane, _r, rkeys in self._closing:  # peers that never answered: release locally
                with lane.lock:
                    for rk in rkeys:
                        self._ucp.ucp_rkey_destroy(rk)
            self._closing = []
            for memh in self._memh.values():
                self._ucp.ucp_mem_unmap(self._w.context, memh)
            self._memh.clear()
        self._w.close()

    def describe(self) -> dict[str, Any]:
        lib = U.lib()
        return {
            "ucx_version": lib.version(),
            "ucx_library": lib.path,
            "prefer_system_ucx": lib.prefer_system,
            "tls": self.opts.tls or "default",
            "err_mode": self.opts.err_mode,
            "progress": self.opts.progress,
            "lanes": len(self._lanes),
            "bytes_per_lane": list(self._lane_bytes),
            "peers": sorted(self._by_name),
            "idle_wakeups": self._w.idle_wakeups,
        }
