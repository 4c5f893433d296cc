"""Posting and status of the moriio backend: the data path.

``post`` groups a validated request by (local region, remote region) pair and issues one
mori ``batch_read``/``batch_write`` per pair on a cached session; ``poll`` folds the
mori statuses into one kvtransport state (``status.py``), applies peer-failure events
popped from the engine, and sends the notification (authenticated, see
``kvtransport.notify``) once every batch succeeded, so it always follows the data.
Connection state comes from ``peers.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtransport.notify import NotificationError
from kvtransport.spi import Op, PollResult, PollState, PostRequest

from .grouping import group_by_region_pair
from .peers import Conn, Peers
from .status import all_settled, classify

__all__ = ["DataPath", "Xfer"]

# Peer-failure reasons that concern a local port/device rather than the attributed peer:
# they fail what is in flight but do not condemn the connection (a port can come back).
_LOCAL_DEVICE_REASONS = {"LOCAL_PORT_DOWN", "LOCAL_DEVICE_FATAL", "PORT_DOWN", "DEVICE_FATAL"}
_MAX_EVENTS_PER_POLL = 1024


@dataclass(eq=False)
class Xfer:
    """Backend handle of one posted transfer: one mori status per region-pair batch."""

    transfer_id: int
    op: Op
    peer: Conn
    statuses: list[Any]
    notify: bytes | None
    nbytes: int
    forced: str | None = None  # failure decided by us (peer failure, disconnect, close)
    final: PollResult | None = None


class DataPath:
    """post / poll / cancel / quiesced / release of one moriio agent, and peer failures."""

    def __init__(self, engine: Any, local: dict[int, Any], peers: Peers, stats: dict[str, int],
                 agent_name: str) -> None:
        self._engine = engine
        self._local = local  # region id -> MemoryDesc (the backend's registrations)
        self._peers = peers
        self._stats = stats
        self.agent_name = agent_name
        self.closed = False

    def _session(self, peer: Conn, local_id: int, remote_id: int) -> Any:
        key = (local_id, remote_id)
        sess = peer.sessions.get(key)
        if sess is None:
            sess = self._engine.create_session(self._local[local_id], peer.remote_mds[remote_id])
            if sess is None:
                raise RuntimeError(
                    f"mori could not open a session from local region {local_id} to region {remote_id} "
                    f"of peer {peer.name!r} (no mori backend can reach that memory pair)"
                )
            peer.sessions[key] = sess
            self._stats["sessions_created"] += 1
        return sess

    def post(self, req: PostRequest) -> Any:
        peer: Conn = req.peer
        if self.closed:
            raise RuntimeError(f"agent {self.agent_name!r} is closed")
        if not peer.current:
            raise RuntimeError(f"peer {peer.name!r} is no longer connected to this moriio agent")
        self._drain_peer_failures()  # apply known failures before adding new work
        if peer.dead is not None:
            raise RuntimeError(f"peer {peer.name!r} failed earlier ({peer.dead}); reconnect with fresh metadata")
        groups = group_by_region_pair(
            req.local_region, req.remote_region, req.local_offset, req.remote_offset, req.length
        )
        handle = Xfer(req.transfer_id, req.op, peer, [], req.notify, req.nbytes)
        for g in groups:
            try:
                sess = self._session(peer, g.local_region, g.remote_region)
                uid = sess.allocate_transfer_uid()
                fn = sess.batch_read if req.op is Op.READ else sess.batch_write
                status = fn(g.local_offsets, g.remote_offsets, g.sizes, uid)
            except Exception as exc:
                if not handle.statuses:
                    raise  # nothing in flight: fail the transfer at once
                # Earlier batches are in flight: report FAILED, quiesced once they settle.
                handle.forced = f"mori could not post batch to peer {peer.name!r}: {type(exc).__name__}: {exc}"
                break
            handle.statuses.append(status)
            self._stats["batches_posted"] += 1
            self._stats["bytes_posted"] += g.nbytes
        peer.inflight.add(handle)
        return handle

    def poll(self, handle: Any) -> PollResult:
        t: Xfer = handle
        if t.final is not None:
            return t.final
        self._drain_peer_failures()
        if t.forced is not None:
            res = PollResult.failed(t.forced, quiesced=all_settled(t.statuses))
            if res.quiesced:
                self._finalize(t, res)
            return res
        res = classify(t.statuses, t.peer.name)
        if res.state is PollState.DONE and t.notify is not None:
            try:
                self._peers.outboxes[t.peer.notify_address].send(t.notify)
                self._stats["notifications_sent"] += 1
            except (NotificationError, KeyError) as exc:
                res = PollResult.failed(f"data moved but the notification to {t.peer.name!r} failed: {exc}")
        if res.state is PollState.FAILED and not res.quiesced:
            return res
        if res.state is not PollState.PENDING:
            self._finalize(t, res)
        return res

    def _finalize(self, t: Xfer, res: PollResult) -> None:
        """Terminal and quiesced: nothing can happen to ``t`` any more; stop tracking it."""
        t.final = res
        t.peer.inflight.discard(t)
        if not t.peer.current and not t.peer.inflight:
            self._peers.all.discard(t.peer)

    def cancel(self, handle: Any) -> bool:
        # mori has no per-transfer cancel: a posted RDMA batch runs to completion or
        # error. Nothing more can land once every batch has settled.
        t: Xfer = handle
        if t.forced is None and t.final is None:
            t.forced = "cancelled by the core"
        return all_settled(t.statuses)

    def quiesced(self, handle: Any) -> bool:
        return all_settled(handle.statuses)

    def release(self, handle: Any) -> None:
        t: Xfer = handle
        t.peer.inflight.discard(t)
        if not t.peer.current and not t.peer.inflight:
            self._peers.all.discard(t.peer)

    # ------------------------------------------------------------------ peer failure
    def _drain_peer_failures(self) -> None:
        pop = getattr(self._engine, "pop_peer_failure", None)
        if pop is None:  # mori older than 1.2.4: only deadlines catch a dead peer
            return
        for _ in range(_MAX_EVENTS_PER_POLL):
            ev = pop()
            if ev is None:
                return
            self._stats["peer_failure_events"] += 1
            reason_name = str(getattr(ev.reason, "name", ev.reason))
            key = str(ev.remote_engine_key)
            where = f" on {ev.device_name}" if getattr(ev, "device_name", "") else ""
            text = f"mori peer failure {reason_name}{where}: {ev.detail or 'no detail'}"
            if key:
                targets = [p for p in self._peers.all if p.engine_key == key]
            else:  # device-wide event: every peer reached through this engine is affected
                targets = list(self._peers.all)
            for p in targets:
                p.fail(f"{text} (peer {p.name!r})")
                if key and reason_name not in _LOCAL_DEVICE_REASONS:
                    p.dead = text
