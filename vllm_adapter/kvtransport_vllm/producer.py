"""Producer half of the worker: holds finished prefills' blocks for a consumer.

Per finished prefill one :class:`Hold`: its blocks stay out of vLLM's hands under a lease
that any consumer message for the key renews. READ mode: the consumer reads, then says
"done" inside the lease (-> ok, blocks freed) or after it (-> expired); lease lapse or
"release" also frees. WRITE mode: once both the hold and the consumer's block ids (and
its hand-shake) exist, one batched WRITE, then "written" to the consumer until it acks.

Hold states (:class:`HoldState`), changed only under the worker lock::

    HELD --consumer's blocks known--> POSTING --agent.write returned--> POSTED
      |                                  |  (refused: straight to NOTIFY;      |
      |                                  |   hand-shake not seen: back to HELD) |
      |                                  v                                      v
      |                               NOTIFY <--------- write ended and quiesced
      v                                  |
    ended (blocks back to vLLM: done_sending) <--consumer acked / lease lapsed

The invariant that keeps a write out of freed blocks: **a hold whose write may be in
flight (POSTING or POSTED) is never ended and never acknowledged**. The engine thread
moves HELD -> POSTING *before* it releases the lock to call ``agent.write`` (UCX works
inside ``post``), so a Cancel / Release / Aborted / Done / lease lapse handled meanwhile
sees POSTING, answers "pending" and keeps the hold; :meth:`Producer.end_hold` refuses to
end an in-flight hold, so no path can break it. POSTED -> NOTIFY and "written" are also
made by the notifier thread (written_notifier.py) the moment the write ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import kvtransport as kvt

from .context import WorkerContext
from .hold import Dest, Hold, HoldState
from .kv_groups import align_tails, flatten, split
from .block_sizes import groups_refusal, paired_segments
from .kv_layout import block_segments, piece_layouts, remote_layouts
from .load_stats import HOLD_CAUSES, Cause, count_outcome, record_transfer, record_written
from .messages import Hello, HoldJob, LayoutInfo, Msg, Reply, WriteReq, Written
from .producer_peers import reconnect

if TYPE_CHECKING:
    from .side_channel import SideChannelClient

log = logging.getLogger(__name__)

__all__ = ["HoldState", "Hold", "Producer"]

_RECENT = 65536  # remembered ended keys (late messages answered "expired", not "pending")
#: consumer hand-shakes kept (beyond, the oldest is forgotten): made-up engine ids cannot grow it
_MAX_CONSUMERS = 1024


def _remember(recent: OrderedDict, key: str, value: Any, bound: int = 0) -> None:
    """Set ``recent[key]`` as its newest entry, forgetting the oldest beyond ``bound`` or _RECENT."""
    recent[key] = value
    recent.move_to_end(key)
    while len(recent) > (bound or _RECENT):
        recent.popitem(last=False)


class Producer:
    """The holds of one worker and the side-channel answers about them."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.holds: dict[str, Hold] = {}  # key -> hold
        self.ended: OrderedDict[str, str] = OrderedDict()  # key -> why (done|expired|released|aborted)
        #: READ: for keys ended "done", the loads that confirmed them (bounded with ``ended``)
        self.confirmed: OrderedDict[str, frozenset[str]] = OrderedDict()
        #: WriteReq that came before the hold (messages race the scheduler's metadata)
        self.early_dest: dict[str, tuple[list[Dest], float]] = {}  # one per consumer rank
        self.consumer_md: OrderedDict[str, bytes] = OrderedDict()  # consumer engine name -> agent metadata
        #: layer-wise WRITE (layerwise.LayerwiseWriter, set by the worker when layerwise_write
        #: is on): its early writes of a key count as in flight for every rule of this module
        self.layerwise: Any = None
        self.consumer_peers: dict[str, Any] = {}
        #: connections a failed write or a new hand-shake retired: closed when the next write
        #: connects again (``producer_peers.reconnect``: new endpoints, not the failed ones)
        self.retired_peers: dict[str, Any] = {}
        self.consumer_layouts: dict[str, LayoutInfo] = {}
        self.done_sending: set[str] = set()
        #: releases from some of several readers before we learnt of the hold: key -> (readers,
        #: {rank: how}). Kept like ``ended``, not for a lease only: a rank whose cancel we acked
        #: has handed its blocks back, so a late write request of its must never be written
        self.early_finished: OrderedDict[str, tuple[int, dict[int, str]]] = OrderedDict()
        #: set whenever a write is posted: wakes the :class:`~.written_notifier.WrittenNotifier`
        self.posted = threading.Event()

    # ------------------------------------------------------------------ engine thread
    def add(self, jobs: list[HoldJob], now: float) -> None:
        """New holds from the scheduler's metadata. Caller holds the lock."""
        for j in jobs:
            if j.key in self.ended:  # consumer released / cancelled before we learnt of it
                self.done_sending.add(j.req_id)
                # counted like a hold that ended so (router flow: a decode engine with nothing
                # to load releases the key before the prefill has finished)
                count_outcome(self.ctx.stats, "hold", HOLD_CAUSES.get(self.ended[j.key], Cause.OK))
                continue
            hold = Hold(j.req_id, j.key, list(j.block_ids), expiry=now + self.ctx.cfg.lease_s,
                        group_sizes=list(j.group_sizes), held_at=now)
            part = self.early_finished.pop(j.key, None)
            if part is not None:
                hold.readers, hold.finished = part[0], dict(part[1])
            early = self.early_dest.pop(j.key, None)
            if early is not None:
                hold.readers = max([hold.readers] + [d.readers for d in early[0]])
                # never a rank that gave up meanwhile (we acked it: its blocks are vLLM's again)
                dests = [d for d in early[0] if d.rank not in hold.finished]
                if dests:
                    hold.dest, hold.queue = dests[0], dests[1:]
            self.holds[j.key] = hold

    def note_aborted(self, key: str) -> None:
        """Our request behind ``key`` was aborted: later messages for it are answered
        "aborted" (not "expired": the same cause as our Aborted notice). Caller holds the lock."""
        self.ended[key] = "aborted"
        self.early_dest.pop(key, None)

    def end_hold(self, h: Hold, why: str) -> bool:
        """Give the blocks back to vLLM (done_sending). Caller holds the lock. Refused
        (False) while a write may be in flight: the invariant of this module."""
        if h.write_in_flight or (self.layerwise is not None and self.layerwise.in_flight(h.key)):
            return False
        self.holds.pop(h.key, None)
        _remember(self.ended, h.key, why)
        if why == "done":
            _remember(self.confirmed, h.key, frozenset(h.confirmed_by))
        self.done_sending.add(h.req_id)
        if why == "expired":
            self.ctx.stats["leases_expired"] += 1
        cause = HOLD_CAUSES.get(why, Cause.OK)
        if cause is Cause.OK and h.write is not None and not h.write_ok:
            cause = Cause.TRANSPORT  # WRITE mode: the consumer acknowledged a failed write
        count_outcome(self.ctx.stats, "hold", cause)
        return True

    def advance(self, now: float) -> None:
        with self.ctx.lock:
            holds = list(self.holds.values())
            for key, (_, exp) in list(self.early_dest.items()):
                if now >= exp:
                    del self.early_dest[key]
        for h in holds:
            self._advance(h, now)

    def _advance(self, h: Hold, now: float) -> None:
        with self.ctx.lock:
            if h.key not in self.holds:
                return
            state = h.state
        if state is HoldState.POSTED:
            if not self.write_ended(h):
                return
            state = HoldState.NOTIFY
        if state is HoldState.NOTIFY:
            self.tell_written(h, self.ctx.client_to)
            with self.ctx.lock:
                if now >= h.expiry and h.key in self.holds:  # consumer never acked: gone
                    self.end_hold(h, "expired")
            return
        with self.ctx.lock:
            if h.key not in self.holds or h.state is not HoldState.HELD:
                return
            if now >= h.expiry:
                self.end_hold(h, "expired")
                return
            if h.dest is None:
                return
            if self.layerwise is not None and self.layerwise.in_flight(h.key):
                return  # layer-wise: the rest is sent (and "written" told) once early writes ended
            dest = h.dest
            h.state = HoldState.POSTING  # before the lock is released (module invariant)
        self._post_write(h, dest)
        if self.write_ended(h) or h.state is HoldState.NOTIFY:  # ended inside post, or refused
            self.tell_written(h, self.ctx.client_to)

    def posted_holds(self) -> list[Hold]:
        """The holds whose write is in flight (POSTED), for the notifier thread."""
        with self.ctx.lock:
            return [h for h in self.holds.values() if h.state is HoldState.POSTED]

    def write_ended(self, h: Hold) -> bool:
        """POSTED -> NOTIFY once the write has ended and nothing more can land (T3); made
        once, by the engine thread or the notifier thread, whichever sees the end first."""
        write = h.write
        if write is None:
            return False
        st = write.status()  # outside the lock: polling may drive the backend
        if st.state is kvt.State.PENDING:
            return False
        if st.state is kvt.State.FAILED and not st.quiesced:
            return False  # keep the blocks aside until nothing more can land (T3)
        ok = st.state is kvt.State.DONE
        with self.ctx.lock:
            if h.state is not HoldState.POSTED or h.write is not write:
                return h.state is HoldState.NOTIFY and h.write is write  # the other thread did it
            if not ok and h.dest is not None and self.consumer_peers.get(h.dest.engine) is h.write.peer:
                self.retired_peers[h.dest.engine] = self.consumer_peers.pop(h.dest.engine)
            if ok:
                self.ctx.stats["bytes"] += h.write.nbytes
                record_transfer(self.ctx.stats, time.monotonic() - h.posted_at, h.write.nbytes,
                                len(h.dest.block_ids) if h.dest else 0)
                record_written(self.ctx.stats, h.held_at)
            else:
                self.ctx.stats["failures"] += 1
            h.state, h.write_ok, h.write_reason, h.last_sent = HoldState.NOTIFY, ok, st.reason, 0.0
        return True

    def tell_written(self, h: Hold, client_to: Callable[[str, int], SideChannelClient]) -> bool:
        """Send "written" for a NOTIFY hold unless sent in the last 50 ms; True if sent.
        ``client_to``: the calling thread's own clients (a DEALER socket serves one thread),
        on which the ack comes back for :meth:`on_reply`."""
        now = time.monotonic()
        with self.ctx.lock:
            if h.key not in self.holds or h.state is not HoldState.NOTIFY or now - h.last_sent <= 0.05:
                return False
            assert h.dest is not None
            h.last_sent, dest = now, h.dest
            msg = Written(key=h.key, ok=h.write_ok, reason=h.write_reason, rank=self.ctx.tp_rank, load=dest.load)
        cid = client_to(dest.host, dest.port).send(msg)
        with self.ctx.lock:
            if h.dest is dest:  # not moved on to a next reader meanwhile
                h.notify_cid = cid
                h.notify_cids.add(cid)
        return True

    def _post_write(self, h: Hold, dest: Dest) -> None:
        """Called in POSTING, without the lock; leaves the hold POSTED, NOTIFY (refused)
        or HELD (nothing posted: the consumer's hand-shake has not arrived yet)."""
        paired = self._pairs(h, dest)
        if paired is None:
            with self.ctx.lock:
                h.state = HoldState.HELD  # hand-shake not seen yet (messages race); next step
            return
        next_state, write = HoldState.NOTIFY, None
        fail: str | None = ""  # None: nothing left to post, every byte is already written
        h.posted_at = time.monotonic()  # POSTING: only this thread touches the hold
        try:
            if isinstance(paired, str):
                fail = paired
            else:
                if self.layerwise is not None:  # only what no layer-wise early write covered
                    paired = self.layerwise.uncovered(h.key, dest, *paired)
                if self.layerwise is None or any(paired[0]):
                    write, next_state = self._write(dest, *paired)
                else:
                    fail = None  # every block already written, layer by layer: nothing left to post
        except Exception as exc:  # a peer's bad block ids or layout: refuse the write, never the step
            fail = f"write refused: {type(exc).__name__}: {exc}"
        except BaseException:
            with self.ctx.lock:  # nothing was posted (the agent fails backend errors itself)
                h.state = HoldState.HELD
            raise
        with self.ctx.lock:
            h.state = next_state
            if next_state is HoldState.POSTED:
                h.write = write
                self.ctx.stats["transfers"] += 1
                self.posted.set()
            elif next_state is HoldState.NOTIFY:
                h.write_ok, h.write_reason, h.last_sent = fail is None, fail or "", 0.0
                if fail is None:  # every byte written already, layer by layer
                    record_written(self.ctx.stats, h.held_at)

    def _pairs(self, h: Hold, dest: Dest) -> tuple[list[list[int]], list[list[int]]] | str | None:
        """Our blocks and the consumer's, paired (a message when they cannot be; None before
        its hand-shake). Equal block sizes: each KV cache group's destination blocks pair
        with ours at the same positions (both lists end at the prompt's last block). Other
        block sizes: the whole lists, paired by token position in :meth:`_write`."""
        info = self.consumer_layouts.get(dest.engine)
        if info is None or self.ctx.layout is None:
            return None
        if info.block_size == self.ctx.layout.block_size:
            return align_tails(split(h.block_ids, h.group_sizes), split(dest.block_ids, dest.group_sizes))
        if h.group_sizes or dest.group_sizes:
            return groups_refusal(self.ctx.layout.block_size, info.block_size)
        return [list(h.block_ids)], [list(dest.block_ids)]

    def _write(self, dest: Dest, src_groups: list[list[int]], dst_groups: list[list[int]]) -> tuple[Any, HoldState]:
        engine = dest.engine
        peer = self.consumer_peers.get(engine)
        if peer is None:
            md = self.consumer_md.get(engine)
            if md is None:
                return None, HoldState.HELD  # hand-shake not seen yet (messages race); next step
            if self._writes_in_flight_on(self.retired_peers.get(engine)):
                return None, HoldState.HELD  # the failed connection drains first; next step
            peer = reconnect(self.ctx.agent, md, self.retired_peers.pop(engine, None))
            self.consumer_peers[engine] = peer
        info = self.consumer_layouts[engine]
        if self.ctx.layout is not None and info.block_size != self.ctx.layout.block_size:
            local, remote = paired_segments(self.ctx.local_layouts, self.ctx.layout, src_groups[0], 0,
                                            remote_layouts(peer, info), info, dst_groups[0], dest.first_token,
                                            dest.src_head, dest.dst_head, dest.num_heads)
            return (self.ctx.agent.write(peer, local, remote, timeout=self.ctx.cfg.transfer_timeout_s),
                    HoldState.POSTED)
        lo, lg_lo, re, lg_re = piece_layouts(self.ctx.local_layouts, self.ctx.layout, dest.src_head,
                                             remote_layouts(peer, info), info, dest.dst_head, dest.num_heads,
                                             self.ctx.layer_group, self.ctx.state_layers, False)
        remote = block_segments(re, *flatten(dst_groups), lg_re)
        local = block_segments(lo, *flatten(src_groups), lg_lo)
        return (self.ctx.agent.write(peer, local, remote, timeout=self.ctx.cfg.transfer_timeout_s),
                HoldState.POSTED)

    def _writes_in_flight_on(self, peer: Any) -> bool:
        """Whether writes posted on ``peer`` (a retired connection) are still pending. Why:
        re-connecting fails every write still on the old connection, turning one failed load
        into many; so new writes wait (HELD) until none is pending, one transfer deadline at
        most. A failed, unquiesced write does not count (its hold keeps the blocks anyway)."""
        if peer is None:
            return False
        with self.ctx.lock:
            return any(h.state is HoldState.POSTED and h.write is not None and h.write.peer is peer
                       and h.write.last_status.state is kvt.State.PENDING for h in self.holds.values())

    def poll_replies(self) -> list[Msg]:
        """Replies on our clients to consumers' reply addresses (engine thread)."""
        out: list[Msg] = []
        for c in self.ctx.reply_clients.values():
            out += c.poll()
        return out

    def on_reply(self, msg: Msg) -> None:
        """The consumer's answer to "written": acked ("ok") or no longer wanted
        ("unknown"): free either way (the write has ended: NOTIFY)."""
        if not isinstance(msg, Reply):
            return
        with self.ctx.lock:
            for key, status in msg.status.items():
                h = self.holds.get(key)
                if h is None or h.state is not HoldState.NOTIFY or msg.cid not in h.notify_cids:
                    continue
                self._dest_done(h, "done" if status == "ok" else "released")

    def _dest_done(self, h: Hold, how: str) -> None:
        """The current destination's rank is finished with us: end the hold if it was the
        last reader, else go on with the next. Caller holds the lock; no write in flight."""
        assert h.dest is not None and not h.write_in_flight
        if h.finish_reader(h.dest.rank, how, 1):
            self.end_hold(h, how)
            return
        h.dest = h.queue.pop(0) if h.queue else None
        h.state, h.write, h.write_ok, h.write_reason, h.notify_cid = HoldState.HELD, None, False, "", 0
        h.notify_cids = set()

    # ------------------------------------------------------------------ side-channel thread
    # Each answer_* is called with the lock held, per key, and returns the key's status.

    def on_hello(self, msg: Hello) -> None:
        old = self.consumer_peers.pop(msg.engine_id, None)  # restarted consumer: reconnect
        if old is not None:
            self.retired_peers[msg.engine_id] = old
        _remember(self.consumer_md, msg.engine_id, msg.agent_md, _MAX_CONSUMERS)
        self.consumer_layouts[msg.engine_id] = msg.layout
        for gone in set(self.consumer_layouts) - set(self.consumer_md):  # forgotten: all three go
            self.consumer_layouts.pop(gone, None)
            self.consumer_peers.pop(gone, None)
            self.retired_peers.pop(gone, None)

    def _unknown(self, key: str, give_up: bool, done: bool, rank: int = -1, readers: int = 1,
                 load: str = "") -> str:
        """Status for a key we hold nothing for."""
        why = self.ended.get(key)
        if why is None and give_up and readers > 1:
            # one of several readers: remember it; the hold waits for the others on arrival
            _, seen = self.early_finished.get(key, (readers, {}))
            seen.setdefault(rank, "released")
            _remember(self.early_finished, key, (readers, seen))
            # its write request, if one came first, must not be written on the hold's arrival
            early = self.early_dest.get(key)
            if early is not None:
                self.early_dest[key] = ([d for d in early[0] if d.rank != rank], early[1])
            return "acked"
        if why is None and give_up:
            # before we learnt of the key: remember, free on arrival
            _remember(self.ended, key, "released")
            self.early_dest.pop(key, None)
            return "acked"
        if why is None:
            return "pending"
        if give_up:
            return "acked"
        if why == "aborted":
            return "aborted"  # the consumer learns why, whichever message reaches it first
        if why == "done" and done and load and load in self.confirmed.get(key, ()):
            return "ok"  # a repeat of a confirmation we answered "ok" (that answer was lost)
        return "expired"  # any other load of this key read blocks we no longer hold

    def _lapsed(self, h: Hold, now: float) -> bool:
        """End a hold whose lease ran out (never one with a write in flight or ended)."""
        return now >= h.expiry and h.state is HoldState.HELD and self.end_hold(h, "expired")

    def answer_done(self, key: str, instance: str, now: float, rank: int = -1, readers: int = 1,
                    load: str = "") -> str:
        """READ: consumer ``rank`` read ``key`` from us; "ok" if our lease held. With several
        readers the blocks are freed once every one confirmed or released. ``load`` names the
        consumer's load (``Done.load``), so only that load's repeat is "ok" after the key ended."""
        h = self.holds.get(key)
        if h is None:
            return self._unknown(key, give_up=False, done=True, load=load)
        if self._lapsed(h, now):
            return "expired"
        if instance and instance != self.ctx.agent.instance:
            return "stale"  # read from our previous incarnation's memory
        if h.write_in_flight:
            return "pending"  # a write of ours is in flight for this key
        if load:
            h.confirmed_by.add(load)
        if h.finish_reader(rank, "done", readers):
            self.end_hold(h, "done")
        else:
            h.expiry = now + self.ctx.cfg.lease_s  # the other readers still read under it
        return "ok"

    def answer_renew(self, key: str, now: float) -> str:
        h = self.holds.get(key)
        if h is None:
            return self._unknown(key, give_up=False, done=False)
        if self._lapsed(h, now):
            return "expired"
        h.expiry = now + self.ctx.cfg.lease_s
        return "ok"

    def answer_give_up(self, key: str, now: float, rank: int = -1, readers: int = 1) -> str:
        """Release (READ) / Cancel (WRITE) from consumer ``rank``: "acked" means no write
        of ours can land in its blocks any more."""
        if self.layerwise is not None and self.layerwise.in_flight(key):
            return "pending"  # a layer-wise early write may still land in its blocks
        h = self.holds.get(key)
        if h is None:
            return self._unknown(key, give_up=True, done=False, rank=rank, readers=readers)
        if self._lapsed(h, now):
            return "acked"
        if h.dest is not None and (h.dest.rank == rank or rank < 0 or h.dest.rank < 0):
            # the rank our current write goes to (rank -1: a peer that names none, treated
            # as the destination of any write, so an ack never comes too early)
            if h.write_in_flight:
                return "pending"  # POSTING / POSTED: no ack until the write has ended
            self._dest_done(h, "released")  # its write (if any) has ended, or never started
            return "acked"
        if h.finish_reader(rank, "released", readers) and not h.write_in_flight:
            self.end_hold(h, "released")
        return "acked"

    def answer_aborted(self, key: str) -> None:
        h = self.holds.get(key)
        if h is not None:
            self.end_hold(h, "released")  # refused while a write is in flight

    def answer_write_req(self, msg: WriteReq, now: float) -> str:
        dest = Dest(msg.engine_id, list(msg.block_ids), msg.reply_host, msg.reply_port, msg.rank, msg.src_head,
                    msg.dst_head, msg.num_heads, msg.readers, list(msg.group_sizes), msg.load, msg.first_token)
        lease = now + self.ctx.cfg.lease_s
        h = self.holds.get(msg.key)
        if h is not None:
            h.readers = max(h.readers, msg.readers)
            if h.dest is not None and h.dest.rank != dest.rank:
                # another consumer rank's slice: written after the current one (one write
                # in flight per hold keeps the cancel rules of this module unchanged)
                if dest.rank not in h.finished and all(d.rank != dest.rank for d in h.queue):
                    h.queue.append(dest)
                h.expiry = lease
                return "ok"
        if msg.engine_id not in self.consumer_md and msg.key not in self.ended:
            # we cannot write to a consumer we never hand-shook with (we restarted)
            if h is not None and h.dest is None and dest.rank not in h.finished:
                h.dest, h.expiry = dest, lease
            elif h is None:
                self._early(msg.key, dest, lease)
            return "hello"
        if h is not None:
            if h.dest is None and dest.rank not in h.finished:  # a resend after its write: ignored
                h.dest = dest
            h.expiry = lease
            return "ok"
        if msg.key in self.ended:
            return "aborted" if self.ended[msg.key] == "aborted" else "expired"
        if self._rank_gave_up(msg.key, dest.rank):
            return "expired"  # a late or duplicated request of a rank whose cancel we acked
        self._early(msg.key, dest, lease)
        return "pending"

    def _rank_gave_up(self, key: str, rank: int) -> bool:
        """Consumer ``rank`` released / cancelled ``key`` before we learnt of the hold."""
        return rank in self.early_finished.get(key, (0, {}))[1]

    def _early(self, key: str, dest: Dest, lease: float) -> None:
        """Remember a destination that came before the hold (one per consumer rank), unless
        that rank has given up on the key: we acked it, its blocks may be reused."""
        if self._rank_gave_up(key, dest.rank):
            return
        dests = [d for d in self.early_dest.get(key, ([], 0.0))[0] if d.rank != dest.rank]
        self.early_dest[key] = (dests + [dest], lease)
