"""Connections to peers: what we export, endpoints per lane, remote keys, peer failure.

This module owns everything about *who* we talk to; :mod:`.datapath` owns *what* moves.
A :class:`Conn` is one connected peer: its exported blob, one UCP endpoint per lane with the
peer's remote keys unpacked on it, and what we know of its health (``failed``, ``dead``).
:class:`Peers` opens and closes those endpoints, turns UCX endpoint errors and the same-host
pid check into ``failed``/``dead``, and closes endpoints asynchronously (remote keys are
destroyed only once their endpoint's close completed).

Locking: every method marked "(lock held)" runs under the state lock (``UcpWorker.lock``);
endpoint calls additionally take their lane's lock (order: state lock, then one lane lock).

Peer failure: endpoints use ``UCP_ERR_HANDLING_MODE_PEER`` when the transports support it
(tcp, cma, verbs) so UCX reports a dead peer. The shared-memory message transports (sysv,
posix) do not; for them a same-host peer is watched by pid + start time + boot id
(:class:`kvtransport.process_identity.ProcessIdentity`). A cross-host peer on a transport
without peer failure support is only caught by the core's deadline.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
from collections.abc import Callable, Sequence
from ctypes import byref, c_void_p

import numpy as np

from kvtransport.errors import PeerMetadataError
from kvtransport.process_identity import ProcessIdentity, ProcessWatch, peer_alive
from kvtransport.spi import RemoteRegion

from . import ucp as U
from .options import UcxOptions
from .wire import CODEC, UcxBlob
from .worker import Lane, UcpWorker


class Conn:
    """Our endpoint to one peer, its unpacked remote keys, and its liveness."""

    def __init__(self, key: int, name: str, exp: UcxBlob, regions: Sequence[RemoteRegion]) -> None:
        self.key = key  # the endpoint error handler's argument
        self.name = name
        self.exp = exp
        self.regions = list(regions)
        self.ident = exp.identity
        #: The peer's pid can be checked from here (same boot, same pid namespace).
        self.same_host = self.ident.checkable_here()
        #: Per lane: our endpoint to the peer, and the remote keys unpacked on it (in
        #: ``regions`` order). Empty while no endpoint is open.
        self.eps: list[int] = []
        self.lane_rkeys: list[list[int]] = []
        self.rk_ids = np.zeros(0, np.int64)  # region ids, sorted
        self.rk_ptrs: list[np.ndarray] = []  # per lane: rkeys in rk_ids order
        self.rk_by_id: list[dict[int, int]] = []  # per lane: region id -> rkey
        #: Whether to check the peer's process after each flush: same host, other process
        #: (an agent of our own process cannot outlive us).
        self.watch_process = self.same_host and self.ident.pid != os.getpid()
        #: Answers "is the peer's process still there" (``ProcessWatch``: its stat file kept
        #: open, ~3 us per check after a flush instead of ~14; not checkable -> None).
        self.watch = ProcessWatch(self.ident)
        self.failed: str | None = None  # set once the peer is known failed
        self.dead = False  # the peer process is confirmed gone (nothing more can land)
        self.broken = False  # our endpoint was closed: reopen before the next post
        self.forced = False  # ... and it was a forced close: every outstanding request ended
        #: Its transfers in flight (``datapath.Xfer``; this module does not look into them).
        self.xfers: set[object] = set()

    def process_gone(self) -> bool:
        """Same-host peer whose process exited, is exiting, or whose pid was recycled."""
        return self.same_host and not self.watch.is_alive()


class Peers:
    """The connection table of one backend and the endpoint life cycle."""

    def __init__(self, w: UcpWorker, opts: UcxOptions,
                 fail_transfers: Callable[[Conn, str], None]) -> None:
        self._w = w
        self._ucp = w.ucp
        self._lanes = w.lanes
        self.opts = opts
        self._force_close = opts.err_mode == "peer"
        #: Fails every transfer of a connection that is dropped (lock held).
        self._fail_transfers = fail_transfers
        self.conns: dict[int, Conn] = {}  # key -> conn (key is the error-handler arg)
        self.by_name: dict[str, Conn] = {}
        #: endpoints being closed: (lane, close request or None, rkeys to destroy after)
        self.closing: list[tuple[Lane, int | None, list[int]]] = []
        self._keys = itertools.count(1)
        self._next_liveness = 0.0
        self._ident = ProcessIdentity.current()
        self._hostname = socket.gethostname()  # informational: the pid check uses the boot id

    # -- export / connect ---------------------------------------------------------------------
    def export(self) -> bytes:
        return CODEC.encode(CODEC.seal(self._ident, address=self._w.address, err_mode=self.opts.err_mode,
                                       hostname=self._hostname, lane_addresses=list(self._w.addresses)))

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Conn:
        exp = CODEC.decode(blob, peer_name)
        conn = Conn(next(self._keys), peer_name, exp, regions)
        with self._w.lock:
            old = self.by_name.get(peer_name)
            if old is not None:
                self.drop(old, f"connection to {peer_name!r} replaced by a new connect")
            self.open(conn)
            self.conns[conn.key] = conn
            self.by_name[peer_name] = conn
        self._w.wake()
        return conn

    def open(self, conn: Conn) -> None:
        """Create an endpoint on every lane and unpack the peer's remote keys on each (lock held)."""
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
                rks = lane_rkeys[lane.index] if lane.index < len(lane_rkeys) else []
                self._close_ep(lane, ep, rks, self._force_close)
            raise
        order = np.argsort(np.array([r.id for r in conn.regions], np.int64), kind="stable")
        conn.eps, conn.lane_rkeys = eps, lane_rkeys
        conn.rk_ids = np.array([conn.regions[i].id for i in order], np.int64)
        conn.rk_ptrs = [np.array([rks[i] for i in order], np.uint64) for rks in lane_rkeys]
        conn.rk_by_id = [{r.id: rk for r, rk in zip(conn.regions, rks)} for rks in lane_rkeys]
        conn.broken = conn.forced = False

    def _create_ep(self, lane: Lane, conn: Conn) -> int:
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

    # -- closing --------------------------------------------------------------------------------
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
        self.closing.append((lane, req, list(rkeys)))
        self._w.wake()

    def shut(self, conn: Conn, force: bool) -> None:
        """Close the connection's endpoints on every lane (lock held); reopened at the next post.

        ``conn.eps`` is replaced *before* any endpoint is closed: a lane thread about to post
        a share checks, under its lane's lock, that the list it was given is still the
        connection's (``datapath.DataPath._post_lane``)."""
        eps, lane_rkeys = conn.eps, conn.lane_rkeys
        conn.eps, conn.lane_rkeys, conn.rk_ptrs, conn.rk_by_id = [], [], [], []
        conn.broken, conn.forced = True, force
        for lane, ep, rkeys in zip(self._lanes, eps, lane_rkeys):
            self._close_ep(lane, ep, rkeys, force)

    def drop(self, conn: Conn, reason: str) -> None:
        """Forget a connection (lock held): fail its transfers, close its endpoints."""
        self.conns.pop(conn.key, None)
        if self.by_name.get(conn.name) is conn:
            del self.by_name[conn.name]
        conn.failed = conn.failed or reason
        if conn.eps and not conn.broken:
            self.shut(conn, force=self._force_close)
        self._fail_transfers(conn, reason)

    def drop_all(self, reason: str) -> None:
        """Drop every connection (lock held)."""
        for conn in list(self.conns.values()):
            self.drop(conn, reason)

    def reap_closing(self) -> None:
        """Free the requests of endpoint closes that completed, and their remote keys (lock held)."""
        if not self.closing:
            return
        keep = []
        for lane, r, rkeys in self.closing:
            with lane.lock:
                if r is not None and self._ucp.ucp_request_check_status(r) == U.UCS_INPROGRESS:
                    keep.append((lane, r, rkeys))
                    continue
                if r is not None:
                    self._ucp.ucp_request_free(r)
                for rk in rkeys:
                    self._ucp.ucp_rkey_destroy(rk)
        self.closing = keep

    def release_closing(self) -> None:
        """At shutdown: destroy the remote keys of closes the peers never answered (lock held)."""
        for lane, _r, rkeys in self.closing:
            with lane.lock:
                for rk in rkeys:
                    self._ucp.ucp_rkey_destroy(rk)
        self.closing = []

    # -- peer failure -----------------------------------------------------------------------------
    def peer_alive(self, conn: Conn) -> bool | None:
        """Same host: pid + start time, gone once every thread of it is (``has_exited``:
        ``dead`` is set when its main thread exits, while another thread may still copy
        into us over cma); across hosts only UCX's own failure report."""
        return peer_alive(conn.watch if conn.watch_process else None,
                          lambda: False if conn.dead or conn.process_gone() else True if conn.same_host else None)

    def absorb_ep_errors(self) -> None:
        """Apply the endpoint errors UCX reported on any lane since the last call (lock held),
        and force-close the failed endpoints at once.

        Why at once, whichever thread absorbs the error: UCX requires the user to close a
        failed endpoint, and until it is force-closed a transfer failed by the error is not
        quiesced (its flush is pending, and the peer may not yet read as exited: a cma copy
        into a killed peer was seen to fail while ``/proc`` still showed it running). The
        progress thread used to close it on its next round; an error reported while the
        posting thread drove lane 0 was absorbed by that thread's poll first, which then
        returned FAILED, not quiesced."""
        for key, status in self._w.take_ep_errors():
            conn = self.conns.get(key)
            if conn is None or conn.broken:
                continue
            conn.failed = conn.failed or (f"peer {conn.name!r} failed: {U.lib().status_string(status)} "
                                          "(UCX endpoint error)")
            conn.dead = conn.dead or conn.process_gone()
            if self._force_close and conn.eps:
                self.shut(conn, force=True)

    def check_alive(self, conn: Conn) -> None:
        """Mark a same-host peer whose process is gone failed and dead (lock held)."""
        if conn.same_host and not conn.dead and conn.process_gone():
            conn.dead = True
            conn.failed = conn.failed or f"peer {conn.name!r} (pid {conn.ident.pid}) exited"

    def after_progress(self, now: float) -> None:
        """Progress-thread round (lock held): endpoint errors, force-close failed endpoints,
        and every ``liveness_interval_s`` the pid check of same-host peers."""
        self.absorb_ep_errors()
        if self._force_close:
            for conn in list(self.conns.values()):
                if conn.failed and not conn.broken and conn.eps:
                    self.shut(conn, force=True)
        if now >= self._next_liveness:
            self._next_liveness = now + self.opts.liveness_interval_s
            for conn in list(self.conns.values()):
                self.check_alive(conn)
