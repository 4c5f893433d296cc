"""Consumer half of the worker: loads remote KV into the blocks vLLM allocated.

Per request one :class:`Recv`, in the states of :class:`RecvState` (changed only under
the worker lock: the read confirmer also moves READ -> CONFIRM -> done)::

    READ:  CONNECT --hand-shake ok--> READ: one batched READ (all layers) --DONE--> CONFIRM
             "done with key?" --ok--> done_recving          (read, then confirm, under lease)
                              --expired/stale/deadline--> load error + done_recving
    WRITE: CONNECT --> WRITE_WAIT: "write into my blocks" --"written ok"--> done_recving
             give up (deadline / abort / producer aborted / write failed) --> CANCEL until
             the producer acks that no write can land any more --> load error

The consumer's half of the stale-write invariant: **once a "write into my blocks" may
have left (``write_requested`` is set before it is sent), the request reaches FINISHED,
and so vLLM may reuse its blocks, only on the producer's word that its write has ended
("written", or "acked" / "expired" for the Cancel), or when every process that could
write is known gone (exited, or silent past its lease plus a transfer deadline)**.
The producer keeps its side (no ack while its write is POSTING or POSTED, see
:mod:`.producer`). READ mode: a failed READ finishes only once quiesced (T3).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import kvtransport as kvt

from .block_sizes import read_segments
from .context import WorkerContext
from .kv_layout import block_segments, piece_layouts
from .load_stats import Cause, LoadClock, record_load, record_transfer
from .load_messages import LoadMessages, plan_ranks
from .messages import Msg, RecvJob, Renew, Reply, Written
from .producer_peers import PeerConn, ProducerPeers
from .recv import READ_END_GRACE_S, WANTS, PieceLoad, Recv, RecvState
from .tp_mapping import TPMappingError

log = logging.getLogger(__name__)

__all__ = ["RecvState", "Recv", "PieceLoad", "PeerConn", "Consumer", "plan_ranks"]


class Consumer:
    """The loads of one worker and its hand-shakes with producers."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.recv: dict[str, Recv] = {}  # req_id -> load
        self.recv_by_key: dict[str, str] = {}  # key -> req_id
        self.producers = ProducerPeers(ctx)
        self.send = LoadMessages(ctx, self.producers)
        self.peers: dict[tuple[str, int], PeerConn] = self.producers.peers
        self.done_recving: set[str] = set()
        #: loads that ended, until ``report`` records their outcome and phases
        self.reporting: dict[str, Recv] = {}
        #: set when a load settles or a producer's "written" arrives (the step's end waits on it)
        self.settle_event = threading.Event()
        #: set when reads are posted: wakes the read confirmer
        self.posted = threading.Event()
        #: whether a read confirmer thread runs (the worker sets it): see _advance_read
        self.read_confirmer_alive: Callable[[], bool] = lambda: False
        self.failed_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self._last_renew = 0.0
        self._handed: list[Msg] = []

    def _set(self, r: Recv, state: RecvState) -> None:
        with self.ctx.lock:
            r.state = state
    # ------------------------------------------------------------------ engine thread
    def add(self, jobs: list[RecvJob], now: float) -> None:
        """New loads from the scheduler's metadata. Caller holds the lock."""
        for job in jobs:
            if job.req_id in self.recv:
                continue
            r = self.recv[job.req_id] = Recv(job, deadline=now + self.ctx.cfg.transfer_timeout_s, started=now,
                                             clock=LoadClock(created=job.created_at, added=now, write=job.mode == "write"))
            if job.refused:  # unusable kv_transfer_params: a load error, nothing to contact
                r.fail(Cause.PARAMS_REFUSED, job.refused)
                self._finish(r, ok=False)
                continue
            other = self.recv_by_key.get(job.key)
            if other is not None and other in self.recv:
                # one prefill's kv_transfer_params given to two requests at once: replies and
                # "written" name only the key, so they could not be told apart; the later
                # request computes its prefill itself (nothing is released: the first loads on)
                r.fail(Cause.PARAMS_REFUSED,
                       f"key {job.key!r} is already being loaded by request {other}: the same "
                       "kv_transfer_params were forwarded to two requests at once")
                self._finish(r, ok=False)
                continue
            self.recv_by_key[job.key] = job.req_id
            try:
                pieces, ranks = plan_ranks(self.ctx, job.remote_tp)
            except TPMappingError as exc:
                # no byte can move; free every producer rank we are one of the releasers of
                r.fail(Cause.HANDSHAKE_REFUSED, f"cannot map KV heads: {exc}")
                d = max(1, self.ctx.tp_size)
                r.releases = {job.port + q: 1 for q in range(job.remote_tp or d) if q % d == self.ctx.tp_rank}
                self._finish(r, ok=False)
                self.send.release_unread(r)
                continue
            r.pieces = [PieceLoad(pc, job.port + pc.producer_rank, ranks[pc.producer_rank]) for pc in pieces]
            r.releases = {job.port + q: n for q, n in ranks.items() if all(pc.producer_rank != q for pc in pieces)}

    def mark_aborted(self, req_ids: set[str] | frozenset[str]) -> None:
        with self.ctx.lock:
            for rid in req_ids:
                r = self.recv.get(rid)
                if r is not None and not r.aborted:
                    r.aborted = True
                    r.fail(Cause.ABORTED, "request aborted", first=True)

    def peer(self, host: str, port: int) -> PeerConn:
        """Our connection to the producer worker at ``port`` (hand-shake sent if due)."""
        p = self.peers.get((host, port))
        if p is not None and p.state == "draining" and not self._reads_in_flight_on(p.kvt_peer):
            p.state = "new"  # nothing more in flight on the old connection: hand-shake again
        return self.producers.get(host, port)

    def _reads_in_flight_on(self, peer: Any) -> bool:
        """Whether reads posted on ``peer`` (a connection to be re-made) are still pending.
        Why: re-making a connection fails every read still on it, turning one failed load
        into many. New loads from that producer wait until none is pending (one transfer
        deadline at most); a failed read keeps its blocks until quiesced whatever happens."""
        with self.ctx.lock:
            return any(r.state is RecvState.READ and pc.transfer is not None and pc.transfer.peer is peer
                       and pc.transfer.last_status.state is kvt.State.PENDING
                       for r in self.recv.values() for pc in r.pieces)

    def poll_replies(self) -> list[Msg]:
        """Take the hand-shake replies; return every other reply (and those :meth:`hand_over` kept)."""
        with self.ctx.lock:
            handed, self._handed = self._handed, []
        return handed + self.producers.poll()

    def hand_over(self, msg: Msg) -> None:
        """A reply another thread read but leaves to the engine thread (it may send)."""
        with self.ctx.lock:
            self._handed.append(msg)

    def on_reply(self, msg: Msg) -> None:
        """A producer rank's per-key answer to our Done / WriteReq / Cancel (matched to the
        piece by the exchange's cid)."""
        if not isinstance(msg, Reply):
            return
        with self.ctx.lock:
            for key, status in msg.status.items():
                rid = self.recv_by_key.get(key)
                r = self.recv.get(rid) if rid else None
                if r is None:
                    continue
                pc = r.piece_by_cid(msg.cid)
                if pc is None:
                    continue  # not about any recent message of this load: dropped (R3)
                pc.heard = time.monotonic()  # it answered, so it is reachable
                # any recent message's verdict counts, or answers slower than the 50 ms resends
                # never would: each is the producer's word and only ends a load or makes it warier
                self._on_status(r, pc, status)

    def _on_status(self, r: Recv, pc: PieceLoad, status: str) -> None:
        if r.state is RecvState.CONFIRM:
            if status == "ok":
                pc.answer = "ok"
                if all(x.answer == "ok" for x in r.pieces):
                    self._finish(r, ok=True)
            elif status == "expired":
                r.fail(Cause.LEASE_EXPIRED, "producer lease expired before confirmation (stale read refused)")
                self.send.release(r)
                self._finish(r, ok=False)
            elif status == "aborted":
                r.peer_aborted = True
                r.fail(Cause.PEER_ABORTED, "producer aborted the request")
                self.send.release(r)
                self._finish(r, ok=False)
            elif status == "stale":
                # we read from a previous incarnation of the producer (restarted at this
                # address): those bytes are not its; hand-shake again
                r.fail(Cause.STALE_READ, "producer restarted since the hand-shake (stale read refused)")
                self._reset_peer(r.job.host, pc.port)
                self.send.release(r)
                self._finish(r, ok=False)
            # "pending": the producer has not learnt of the key yet; resend later
        elif r.state is RecvState.CANCEL and status in ("acked", "expired"):
            pc.answer = "acked"  # this producer rank's word: none of its writes can land any more
            if all(x.answer == "acked" or not x.writers for x in r.pieces):
                self._finish(r, ok=False)
        elif r.state is RecvState.WRITE_WAIT and status in ("expired", "aborted"):
            if status == "aborted":  # same cause as the producer's Aborted notice
                r.peer_aborted = True
                r.fail(Cause.PEER_ABORTED, "producer aborted the request")
            else:
                r.fail(Cause.LEASE_EXPIRED, "producer no longer holds this request")
            self._start_giving_up(r)
        elif r.state is RecvState.WRITE_WAIT and status == "hello":
            # the producer does not know us (it restarted): hand-shake again; the write
            # request is re-sent until the deadline. The process that answered keeps our
            # blocks as the destination and writes once it has our hand-shake, and it is not
            # the process our hand-shake named: a writer we cannot watch (never "gone")
            if all(w is not None for w in pc.writers):
                pc.writers.append(None)
            self._reset_peer(r.job.host, pc.port)
            self.peer(r.job.host, pc.port)

    def advance(self, now: float) -> None:
        with self.ctx.lock:
            recvs = list(self.recv.values())
        for r in recvs:
            with self.ctx.lock:  # the read confirmer also moves loads out of READ and CONFIRM
                step = _STEPS.get(r.state)
                if step is not None:
                    step(self, r, now, r.aborted or r.peer_aborted or now >= r.deadline)

    def _advance_connect(self, r: Recv, now: float, gave_up: bool) -> None:
        job = r.job
        self.send.release_unread(r)
        if gave_up:
            if r.peer_aborted:
                r.fail(Cause.PEER_ABORTED, "producer aborted", first=True)
            r.fail(Cause.TIMEOUT, "timed out before connecting", first=True)
            self._start_giving_up(r)
            return
        conns = []
        for pc in r.pieces:
            p = self.peer(job.host, pc.port)
            if ((p.state == "ready" or (p.state == "failed" and p.failed_at < r.started)) and job.remote_engine_id
                    and p.engine_name != f"{job.remote_engine_id}-tp{pc.piece.producer_rank}"):
                # another producer now answers at this address (restarted), or the hand-shake
                # failed before this load began: hand-shake again (once per load: a hand-shake
                # that fails during this load ends it with the reason, not by its deadline)
                p.state = "new"
                p = self.peer(job.host, pc.port)
            elif p.state == "ready" and self.ctx.agent.peer_alive(p.kvt_peer) is False:
                # the process we hand-shook with has exited: a producer restarted under the
                # same engine id answers here now. Hand-shake with it before asking it to
                # write, so the load knows which process writes into its blocks
                p.state = "new"
                p = self.peer(job.host, pc.port)
            conns.append(p)
        failed = next((p for p in conns if p.state == "failed"), None)
        expected = job.remote_tp or self.ctx.tp_size
        wrong_tp = next((p for p in conns if p.state == "ready" and p.info is not None
                         and p.info.tp_size != expected), None)
        if failed is not None:
            r.fail(Cause.HANDSHAKE_REFUSED, failed.error)
            self._start_giving_up(r)
        elif wrong_tp is not None:
            theirs = wrong_tp.info.tp_size  # type: ignore[union-attr]
            # free every producer rank at once: each by one consumer rank (q mod our TP size)
            d = max(1, self.ctx.tp_size)
            r.releases = {job.port + q: 1 for q in range(theirs)
                          if q % d == self.ctx.tp_rank and all(pc.piece.producer_rank != q for pc in r.pieces)}
            r.fail(Cause.HANDSHAKE_REFUSED,
                   f"producer {wrong_tp.engine_name} at {wrong_tp.host}:{wrong_tp.port} has tp_size {theirs} but "
                   f"kv_transfer_params said {job.remote_tp or 'nothing'} (assumed {expected}); the router must "
                   "forward the producer's tp_size")
            self._start_giving_up(r)
        elif all(p.state == "ready" for p in conns):
            self._start(r, conns, now)

    def read_ended(self, r: Recv) -> bool:
        """READ -> CONFIRM once every read of ``r`` moved its bytes; True for the one call that made
        the step (engine thread or :mod:`.read_confirmer`, under the lock). The caller confirms."""
        with self.ctx.lock:
            posted = [pc.transfer for pc in r.pieces if pc.transfer is not None]
            if (r.state is not RecvState.READ or r.aborted or r.post_failed
                    or not all(t.status().state is kvt.State.DONE for t in posted)):
                return False
            r.clock.transferred = time.monotonic()
            nbytes = sum(t.nbytes for t in posted)
            self.ctx.stats["bytes"] += nbytes
            record_transfer(self.ctx.stats, r.clock.transferred - r.clock.posted, nbytes, len(r.job.local_block_ids))
            r.state = RecvState.CONFIRM
            return True

    def _advance_read(self, r: Recv, now: float, gave_up: bool) -> None:
        # a live read confirmer takes the end (answers to ours are read a step late) unless it is late
        done_at = r.reads_done_at()
        ours = not self.read_confirmer_alive() or (done_at is not None and done_at < now - READ_END_GRACE_S)
        if ours and self.read_ended(r):
            self.send.confirm(r, now)
            return
        posted = [pc for pc in r.pieces if pc.transfer is not None]
        sts = [pc.transfer.status() for pc in posted]
        if any(st.state is kvt.State.PENDING for st in sts):
            return  # the core fails it by its deadline (T2)
        if any(st.state is kvt.State.FAILED and not st.quiesced for st in sts):
            return  # a late byte may still land (T3): wait until it cannot
        if all(st.state is kvt.State.DONE for st in sts) and not r.post_failed:
            if r.aborted:
                self.send.release(r)
                self._finish(r, ok=False)
            elif ours and self.read_ended(r):  # the last read ended between the two looks
                self.send.confirm(r, now)
            return
        for pc, st in zip(posted, sts):  # FAILED and quiesced: no late byte can land any more
            if st.state is kvt.State.FAILED:
                r.fail(Cause.TRANSPORT, f"read from producer rank {pc.piece.producer_rank} failed: {st.reason}",
                       first=True)
                self._reset_peer(r.job.host, pc.port)
        self.send.release(r)
        self._finish(r, ok=False)

    def _advance_confirm(self, r: Recv, now: float, gave_up: bool) -> None:
        if gave_up:
            r.fail(Cause.TIMEOUT, "no confirmation from the producer before the deadline", first=True)
            self.send.release(r)
            self._finish(r, ok=False)
        elif now - r.last_sent > 0.05:
            self.send.confirm(r, now)

    def _advance_write_wait(self, r: Recv, now: float, gave_up: bool) -> None:
        written = r.written
        if written is True:
            self._finish(r, ok=True)
        elif written is False or gave_up:
            if written is False:
                r.fail(Cause.TRANSPORT, "producer write failed", first=True)
            r.fail(Cause.TIMEOUT, "write not received before the deadline", first=True)
            self._start_giving_up(r)
        elif now - r.last_sent > 0.5:
            self.send.write_req(r, now)  # idempotent on the producer

    def _advance_cancel(self, r: Recv, now: float, gave_up: bool) -> None:
        if now - r.last_sent > 0.05:
            self.send.cancel(r, now)
        if r.writers_gone(self.ctx.agent.peer_alive):
            # every process that could write into our blocks has exited ("known gone")
            r.fail(Cause.PEER_GONE, r.error + "; producer process is gone: no write can land any more")
            self._finish(r, ok=False)
        elif now >= r.silent_since + self.ctx.cfg.lease_s + self.ctx.cfg.transfer_timeout_s:
            # Silent longer than its lease plus a transfer deadline: its hold is dropped and
            # any write it posted has ended (known gone). Counted from its last answer: one
            # still answering "pending" has a write in flight (a copy can outlast deadlines).
            r.fail(Cause.PEER_GONE, r.error + "; producer unreachable, considered gone")
            self._finish(r, ok=False)

    def _start(self, r: Recv, conns: list[PeerConn], now: float) -> None:
        job = r.job
        r.clock.posted = now
        if job.mode == "write":
            self._set(r, RecvState.WRITE_WAIT)
            self.send.write_req(r, now)
            return
        for pc, p in zip(r.pieces, conns):
            piece = pc.piece
            try:
                if p.info is not None and self.ctx.layout is not None and p.info.block_size != self.ctx.layout.block_size:
                    local, remote = read_segments(job, piece, self.ctx.local_layouts, self.ctx.layout, p.layouts,
                                                  p.info)
                else:
                    lo, lg_lo, re, lg_re = piece_layouts(self.ctx.local_layouts, self.ctx.layout, piece.local_head,
                                                         p.layouts, p.info, piece.remote_head, piece.num_heads,
                                                         self.ctx.layer_group, self.ctx.state_layers, True)
                    local = block_segments(lo, job.local_block_ids, job.group_sizes, lg_lo)
                    remote = block_segments(re, job.remote_block_ids, job.group_sizes, lg_re)
                # the READ's own deadline is the load's (read the clock now: ``now`` was taken at
                # the start of this progress call, and the core adds the timeout to its clock)
                pc.transfer = self.ctx.agent.read(p.kvt_peer, local, remote,
                                                  timeout=max(0.001, r.deadline - time.monotonic()))
                pc.instance = p.kvt_peer.instance
            except (kvt.errors.KVTransportError, ValueError) as exc:
                r.fail(Cause.TRANSPORT, f"read refused: {exc}", first=True)
                r.post_failed = True
                self._reset_peer(job.host, pc.port)
                break
            self.ctx.stats["transfers"] += 1
        self._set(r, RecvState.READ)
        self.posted.set()
        # A small READ often completes during the post (loopback, shared memory): confirm it
        # in this same step instead of one engine step later.
        self.ctx.agent.progress()
        self._advance_read(r, time.monotonic(), False)

    def _reset_peer(self, host: str, port: int) -> None:
        """After a failed transfer, hand-shake again (the producer may have restarted with new memory)."""
        p = self.peers.get((host, port))
        if p is not None and p.state == "ready":
            p.state = "draining"  # hand-shake again once no read on it is pending (``peer``)

    def _start_giving_up(self, r: Recv) -> None:
        """Stop waiting for ``r``. READ: the producer ranks free. WRITE: cancel, keep the blocks until each acks."""
        if r.job.mode == "write" and r.write_requested:
            self._set(r, RecvState.CANCEL)
            self.send.cancel(r, time.monotonic())
            if all(not pc.writers for pc in r.pieces):
                self._finish(r, ok=False)
        else:
            self.send.release(r)
            self._finish(r, ok=False)

    def _finish(self, r: Recv, ok: bool) -> None:
        """Report ``r`` to vLLM (done_recving): from here its blocks may be reused."""
        with self.ctx.lock:
            if r.state is RecvState.FINISHED:
                return
            r.state = RecvState.FINISHED
            r.clock.finished = time.monotonic()
            if ok:
                r.cause = Cause.OK
            elif r.cause is Cause.OK:  # failed without a named reason
                r.cause = Cause.TRANSPORT
            self.reporting[r.job.req_id] = r
            self.recv.pop(r.job.req_id, None)
            if self.recv_by_key.get(r.job.key) == r.job.req_id:  # not another load's key
                self.recv_by_key.pop(r.job.key, None)
            self.done_recving.add(r.job.req_id)
            self.settle_event.set()
            stats = self.ctx.stats
            latency = time.monotonic() - r.started
            if ok:
                stats["loads_ok"] += 1
                stats["latency_s_sum"] += latency
                stats["latency_s_max"] = max(stats["latency_s_max"], latency)
            else:
                stats["failures"] += 1
                if not r.aborted:
                    self.failed_recving.add(r.job.req_id)
                    self.load_errors.update(r.job.local_block_ids)
                log.warning("kvtransport: load of request %s (key %s) failed: %s",
                            r.job.req_id, r.job.key, r.error or "unknown")

    def awaiting_replies(self) -> tuple[list[Any], list[Recv]]:
        """Loads needing only the producer's word: the clients READ confirmations await (sent, or
        due from the read confirmer: reads ended), WRITEs awaiting "written"."""
        with self.ctx.lock:
            confirming = [r for r in self.recv.values() if r.state is RecvState.CONFIRM
                          or r.state is RecvState.READ and not r.aborted and r.reads_done_at() is not None]
            writes = [r for r in self.recv.values()
                      if r.state is RecvState.WRITE_WAIT and r.write_requested and r.written is None]
        clients = {id(p.client): p.client for r in confirming for pc in r.pieces
                   if (p := self.peers.get((r.job.host, pc.port))) is not None}
        return list(clients.values()), writes

    def report(self, req_ids: set[str], now: float, step_ends: Sequence[float] = ()) -> None:
        """Record the outcome and phase timings of loads just handed to vLLM (``step_ends``:
        see :meth:`LoadClock.phases`). Caller holds the lock."""
        for rid in req_ids:
            r = self.reporting.pop(rid, None)
            if r is not None and r.clock is not None:
                record_load(self.ctx.stats, r.clock, now, r.cause, step_ends)

    def renew(self, now: float) -> None:
        """Renew every producer rank's lease on each key we still want (a slow live consumer keeps its KV)."""
        if now - self._last_renew < max(0.05, self.ctx.cfg.lease_s / 4):
            return
        self._last_renew = now
        by_peer: dict[tuple[str, int], list[str]] = {}
        with self.ctx.lock:
            for r in self.recv.values():
                if r.state in WANTS:
                    for pc in r.pieces:
                        by_peer.setdefault((r.job.host, pc.port), []).append(r.job.key)
        for (host, port), keys in by_peer.items():
            p = self.peers.get((host, port))
            if p is not None:
                p.client.send(Renew(keys=keys))

    # ------------------------------------------------------------------ side-channel thread
    # Called with the lock held.

    def answer_written(self, msg: Written) -> str:
        """Producer rank ``msg.rank``'s write for ``msg.key`` has ended (ok or not)."""
        rid = self.recv_by_key.get(msg.key)
        r = self.recv.get(rid) if rid else None
        pc = next((x for x in r.pieces if x.piece.producer_rank == msg.rank), None) if r is not None else None
        if r is None or pc is None or r.state not in (RecvState.WRITE_WAIT, RecvState.CANCEL):
            return "unknown"  # late / duplicate: dropped (R3)
        if msg.load and msg.load != r.token:
            return "unknown"  # the end of a write into an earlier load's blocks of this key
        pc.written = msg.ok
        self.settle_event.set()
        if msg.ok and r.clock is not None and r.written is True:
            r.clock.transferred = time.monotonic()
        if r.state is RecvState.WRITE_WAIT and not msg.ok:
            r.fail(Cause.TRANSPORT, f"producer write failed: {msg.reason}")
        return "ok"  # in CANCEL: nothing more can land; the producer acks our next Cancel

    def answer_peer_aborted(self, key: str) -> bool:
        """The producer aborted the request behind ``key``; False if it is not ours."""
        rid = self.recv_by_key.get(key)
        r = self.recv.get(rid) if rid else None
        if r is None:
            return False
        r.peer_aborted = True
        r.fail(Cause.PEER_ABORTED, "producer aborted the request")
        return True


_STEPS = {
    RecvState.CONNECT: Consumer._advance_connect,
    RecvState.READ: Consumer._advance_read,
    RecvState.CONFIRM: Consumer._advance_confirm,
    RecvState.WRITE_WAIT: Consumer._advance_write_wait,
    RecvState.CANCEL: Consumer._advance_cancel,
}
