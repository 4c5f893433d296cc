"""Block-release races of the WRITE lifecycle, driven message by message.

These tests drive the connector's own state machines (``Producer``, ``Consumer``) directly,
with a stand-in worker context: no engine, no backend, no socket. What they check is the
protocol's decisions -- which destination a producer writes to, when a consumer hands its
blocks back -- in interleavings that real pairs reach only by chance (the soak found one of
them: a producer SIGKILLed and restarted under the same engine id wrote a request's KV into
blocks the consumer had already handed back, which two later requests then reported as
theirs). The byte-level consequences are checked by the soak and by
``test_stale_write_race.py`` on real engines; each case here failed before its fix.
"""

from __future__ import annotations

import itertools
import threading
import time
from types import SimpleNamespace

import pytest

import kvtransport as kvt

import kvtransport_vllm.consumer as consumer_module
from kvtransport_vllm.consumer import Consumer, RecvState
from kvtransport_vllm.load_stats import new_stats
from kvtransport_vllm.messages import HoldJob, RecvJob, Reply, WriteReq, Written
from kvtransport_vllm.producer import Producer
from kvtransport_vllm.producer_peers import PeerConn

_cids = itertools.count(1)


class _Client:
    """Records what the consumer sends; gives every message a fresh cid, as the side channel does."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> int:
        msg.cid = next(_cids)
        self.sent.append(msg)
        return msg.cid

    def poll(self) -> list:
        return []


class _Liveness:
    """Stand-in for ``Agent.peer_alive``: which producer processes run."""

    def __init__(self, alive: dict[str, bool]) -> None:
        self.alive = alive

    def peer_alive(self, peer) -> bool | None:
        return self.alive.get(peer)


@pytest.fixture
def clock(monkeypatch):
    """The consumer's clock, moved by the test only (it stamps replies with time.monotonic())."""
    now = [time.monotonic()]
    monkeypatch.setattr(consumer_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def _consumer(alive: dict[str, bool]) -> Consumer:
    cfg = SimpleNamespace(lease_s=2.0, transfer_timeout_s=1.0, side_channel_host="h")
    layout = SimpleNamespace(kv_heads=1, total_kv_heads=1)
    ctx = SimpleNamespace(cfg=cfg, lock=threading.RLock(), stats=new_stats(), agent=_Liveness(alive), tp_rank=0,
                          tp_size=1, name="C-tp0", port=9, layout=layout, agent_md=b"md",
                          new_client=lambda h, p: _Client(), client_to=lambda h, p: _Client())
    return Consumer(ctx)


def _write_load(c: Consumer, now: float) -> None:
    with c.ctx.lock:
        c.add([RecvJob(req_id="r", key="K", mode="write", local_block_ids=[5, 6], remote_block_ids=[],
                       host="h", port=100, remote_engine_id="P")], now)


def _started_write_load(alive: dict[str, bool], hand_shaken_with: str, now: float) -> tuple[Consumer, object]:
    """A consumer whose hand-shake with the producer at h:100 names ``hand_shaken_with``, after
    one step of a new WRITE load ``r`` of key K."""
    c = _consumer(alive)
    c.producers.peers[("h", 100)] = PeerConn("h", 100, _Client(), state="ready", kvt_peer=hand_shaken_with,
                                             engine_name="P-tp0")
    _write_load(c, now)
    c.advance(now)
    return c, c.recv["r"]


def _producer() -> tuple[Producer, list]:
    cfg = SimpleNamespace(lease_s=30.0, transfer_timeout_s=5.0)
    ctx = SimpleNamespace(cfg=cfg, lock=threading.RLock(), stats=new_stats(), agent=None, tp_rank=0,
                          layout=None, local_layouts=[], layer_group=[])
    p = Producer(ctx)
    p.consumer_md["C-tp0"] = p.consumer_md["C-tp1"] = b"md"
    posted: list = []
    p._post_write = lambda hold, dest: posted.append(dest)  # the write the engine thread would post
    return p, posted


def _write_req(rank: int, blocks: list[int], readers: int = 2) -> WriteReq:
    return WriteReq(key="K", block_ids=blocks, engine_id=f"C-tp{rank}", reply_host="h", reply_port=1 + rank,
                    rank=rank, readers=readers, src_head=rank, dst_head=0, num_heads=1)


# -- producer: a consumer rank that gave up before the hold existed --------------------------
def test_reader_cancelled_before_the_hold_is_never_written():
    """Consumer TP 2 over producer TP 1 (two readers). Rank 1 asks for its write before the
    producer knows the hold, then cancels and is acked: its blocks are vLLM's again. When the
    hold arrives, rank 1's early destination must be dropped; rank 0's is written."""
    p, posted = _producer()
    now = time.monotonic()
    assert p.answer_write_req(_write_req(1, [7, 8]), now) == "pending"
    assert p.answer_write_req(_write_req(0, [3, 4]), now) == "pending"
    assert p.answer_give_up("K", now, rank=1, readers=2) == "acked"
    p.add([HoldJob(req_id="r", key="K", block_ids=[1, 2])], now)
    p._advance(p.holds["K"], now)
    assert [d.rank for d in posted] == [0], posted


def test_late_write_request_of_a_cancelled_reader_is_refused():
    """A write request of rank 1 delayed past its own (acked) cancel is answered "expired"
    and never becomes a destination, however long after the cancel it comes."""
    p, posted = _producer()
    now = time.monotonic()
    assert p.answer_give_up("K", now, rank=1, readers=2) == "acked"
    p.advance(now + 100.0)  # long past any lease: the record of rank 1's cancel is kept
    assert p.answer_write_req(_write_req(1, [7, 8]), now + 100.0) == "expired"
    p.add([HoldJob(req_id="r", key="K", block_ids=[1, 2])], now + 100.0)
    h = p.holds["K"]
    p._advance(h, now + 100.0)
    assert posted == [] and h.dest is None, (posted, h.dest)


# -- consumer: which process may still write -------------------------------------------------
def test_hand_shake_with_an_exited_producer_is_renewed_before_the_write_request(clock):
    """The producer we hand-shook with (P1) exited; another process (P2) answers at its address
    under the same engine id. A new load must hand-shake again instead of sending its write
    request on P1's hand-shake: P1's exit would later read as "no write can land", while P2,
    which received the request, may be writing."""
    c, r = _started_write_load({"P1": False, "P2": True}, "P1", clock[0])
    assert r.state is RecvState.CONNECT, r.state
    assert c.producers.peers[("h", 100)].state != "ready"
    assert r.pieces[0].writers == []


def test_producer_that_answers_hello_is_a_writer_its_predecessors_exit_does_not_clear(clock):
    """P1 was alive when the write request left, then died; P2 (restarted, same engine id)
    received the request, answered "hello" and keeps our blocks as its destination. After the
    request is aborted, P1's exit must not end the load: only P2's ack (or its silence for
    lease + timeout) may."""
    alive = {"P1": True, "P2": True}
    now = clock[0]
    c, r = _started_write_load(alive, "P1", now)
    assert r.state is RecvState.WRITE_WAIT and r.pieces[0].writers == ["P1"]
    alive["P1"] = False
    c.on_reply(Reply(cid=r.pieces[0].cid, status={"K": "hello"}))
    c.mark_aborted({"r"})
    c.advance(now + 0.1)
    assert r.state is RecvState.CANCEL
    for k in range(1, 20):  # answered "pending" meanwhile: its write may be in flight
        clock[0] = now + 0.1 + 0.06 * k
        c.advance(clock[0])
        c.on_reply(Reply(cid=r.pieces[0].cid, status={"K": "pending"}))
    assert "r" not in c.done_recving, "blocks handed back while the producer that has them may write"
    c.on_reply(Reply(cid=r.pieces[0].cid, status={"K": "acked"}))
    assert "r" in c.done_recving  # the writer's own word ends it


def test_write_request_is_not_resent_past_the_producer_that_exited(clock):
    """P1 received our write request and exited; another load has begun a new hand-shake at
    its address, so the connection is no longer ready. A resend could reach only a process we
    cannot watch (a restart, or nobody): none leaves, and at the deadline P1's exit ends the
    load at once, instead of after lease + timeout (an end-to-end kill test caught a request
    kept 15 s past the lease by such a resend)."""
    alive = {"P1": True}
    now = clock[0]
    c, r = _started_write_load(alive, "P1", now)
    assert r.state is RecvState.WRITE_WAIT and r.pieces[0].writers == ["P1"]
    alive["P1"] = False
    peer = c.producers.peers[("h", 100)]
    peer.state, peer.last_hello = "hello", time.monotonic()  # what a new load's CONNECT step does
    sent = len(peer.client.sent)
    clock[0] = now + 0.6  # past the 0.5 s resend interval, before the 1 s deadline
    c.advance(clock[0])
    assert not [m for m in peer.client.sent[sent:] if isinstance(m, WriteReq)], "write request re-sent"
    assert r.pieces[0].writers == ["P1"]
    clock[0] = now + 1.1  # past the deadline: cancelling, and the only writer has exited
    c.advance(clock[0])
    c.advance(clock[0])
    assert "r" in c.done_recving, r.state


def test_cancel_acked_only_in_answer_to_superseded_cancels_ends_the_load(clock):
    """Every answer comes 60 ms after the Cancel it answers while the consumer resends every
    50 ms (a slow network or a busy producer), so each names a superseded cid. The producer's
    "acked" still ends the load: acting on the latest cid's verdict only, the load would wait
    forever, since the answers keep showing the producer reachable (the lifecycle state
    machine found requests stranded so)."""
    t0 = clock[0]
    c, r = _started_write_load({"P": True}, "P", t0)
    c.mark_aborted({"r"})
    c.advance(t0 + 0.01)
    assert r.state is RecvState.CANCEL
    old = r.pieces[0].cid
    clock[0] = t0 + 0.07
    c.advance(clock[0])  # resent: ``old`` is superseded
    assert r.pieces[0].cid != old
    c.on_reply(Reply(cid=old, status={"K": "acked"}))
    assert "r" in c.done_recving, r.state


def test_read_confirmed_only_in_answer_to_superseded_confirmations_is_loaded(clock):
    """READ: the producer's "ok" to a confirmation comes after the consumer has re-sent it (an
    answer slower than 50 ms). It settles the load: acting on the latest cid's verdict only,
    every READ would fail at its deadline whenever answers are that slow."""
    t0 = clock[0]
    c = _consumer({"P": True})
    c.producers.peers[("h", 100)] = PeerConn("h", 100, _Client(), state="ready", kvt_peer="P", engine_name="P-tp0")
    with c.ctx.lock:
        c.add([RecvJob(req_id="r", key="K", mode="read", local_block_ids=[5, 6], remote_block_ids=[1, 2],
                       host="h", port=100, remote_engine_id="P")], t0)
    r = c.recv["r"]
    r.state = RecvState.CONFIRM  # the read has ended: what ``read_ended`` makes of it
    c.send.confirm(r, t0)
    old = r.pieces[0].cid
    clock[0] = t0 + 0.06
    c.advance(clock[0])  # re-sent: ``old`` is superseded
    assert r.pieces[0].cid != old
    c.on_reply(Reply(cid=old, status={"K": "ok"}))
    assert "r" in c.done_recving and r.cause.value == "ok", (r.state, r.cause)


class _ReadEndingBetweenLooks:
    """A READ whose first status look finds it pending and every later one done: it ends
    while the engine thread looks at it (a backend moving bytes on its own thread)."""

    nbytes = 64

    def __init__(self) -> None:
        self.looks = 0

    def status(self):
        self.looks += 1
        return kvt.TransferStatus(kvt.State.PENDING if self.looks == 1 else kvt.State.DONE)

    @property
    def last_status(self):
        return kvt.TransferStatus(kvt.State.PENDING if self.looks < 2 else kvt.State.DONE)


def test_read_ending_while_the_engine_thread_looks_is_confirmed_not_failed(clock):
    """The engine thread's first look finds the READ pending, its second done. The load goes
    on to its confirmation: taking "done now" for "aborted" failed it with no reason (a UCX
    pair in the end-to-end tests, whose bytes move on the backend's own thread)."""
    t0 = clock[0]
    c = _consumer({"P": True})
    peer = PeerConn("h", 100, _Client(), state="ready", kvt_peer="P", engine_name="P-tp0")
    c.producers.peers[("h", 100)] = peer
    with c.ctx.lock:
        c.add([RecvJob(req_id="r", key="K", mode="read", local_block_ids=[5, 6], remote_block_ids=[1, 2],
                       host="h", port=100, remote_engine_id="P")], t0)
    r = c.recv["r"]
    r.pieces[0].transfer = _ReadEndingBetweenLooks()
    r.state = RecvState.READ  # posted: what ``_start`` makes of it
    c.advance(t0)
    assert "r" not in c.done_recving, f"load ended: {r.cause} {r.error!r}"
    assert r.state is RecvState.CONFIRM, r.state
    assert any(type(m).__name__ == "Done" for m in peer.client.sent), "no confirmation sent"


def test_late_pending_replies_keep_a_cancelling_load_from_considering_its_producer_gone(clock):
    """The producer answers every Cancel "pending" (its write is in flight), each answer 60 ms
    after the Cancel it answers while the consumer resends every 50 ms: every answer names a
    superseded cid. They still show the producer is reachable, so the load must not hand its
    blocks back after lease + timeout (3 s here)."""
    t0 = clock[0]
    c, r = _started_write_load({"P": True}, "P", t0)
    c.mark_aborted({"r"})
    c.advance(t0 + 0.01)
    assert r.state is RecvState.CANCEL
    t, last = t0 + 0.01, r.pieces[0].cid
    for _ in range(80):  # 4.8 s of answers, each one cid late
        t += 0.06
        clock[0] = t
        c.advance(t)
        c.on_reply(Reply(cid=last, status={"K": "pending"}))
        last = r.pieces[0].cid
    assert "r" not in c.done_recving, f"considered gone although it answered; heard={r.pieces[0].heard}"
    # silence after the last answer still frees the blocks (the producer may really be gone)
    clock[0] = t + c.ctx.cfg.lease_s + c.ctx.cfg.transfer_timeout_s + 0.1
    c.advance(clock[0])
    assert "r" in c.done_recving


# -- one key, two loads ----------------------------------------------------------------------
def test_repeated_confirmation_is_ok_only_for_the_load_that_confirmed():
    """READ: after the hold ended "done", a Done for the key is answered "ok" only when it
    repeats the confirming load's own (its first answer was lost). Another load of the same
    key -- a router retry or hedge forwarding the same kv_transfer_params -- read blocks we
    no longer hold, which may carry another request's KV: "expired"."""
    p, _ = _producer()
    p.ctx.agent = SimpleNamespace(instance="P-1")
    now = time.monotonic()
    p.add([HoldJob(req_id="r", key="K", block_ids=[1, 2])], now)
    assert p.answer_done("K", "P-1", now, load="load-A") == "ok"
    assert "K" not in p.holds  # the blocks are vLLM's again
    assert p.answer_done("K", "P-1", now, load="load-A") == "ok"
    assert p.answer_done("K", "P-1", now, load="load-B") == "expired"
    assert p.answer_done("K", "P-1", now) == "expired"  # a load that names none


def test_second_concurrent_load_of_a_key_is_refused_and_the_first_goes_on(clock):
    """Two requests given one prefill's params at once: replies and "written" name only the
    key, so the later load is refused (its request computes the prefill itself) and the
    first keeps the key's answers."""
    c = _consumer({"P": True})
    now = clock[0]
    with c.ctx.lock:
        c.add([RecvJob(req_id="r1", key="K", mode="write", local_block_ids=[5], remote_block_ids=[],
                       host="h", port=100, remote_engine_id="P"),
               RecvJob(req_id="r2", key="K", mode="write", local_block_ids=[6], remote_block_ids=[],
                       host="h", port=100, remote_engine_id="P")], now)
    assert "r2" in c.done_recving and "r2" in c.failed_recving
    assert "already being loaded by request r1" in c.reporting["r2"].error
    assert "r1" in c.recv and c.recv_by_key["K"] == "r1"


def test_late_written_for_an_earlier_load_of_the_key_is_not_taken_as_the_next_ones(clock):
    """WRITE: load A of key K gives up and ends (the producer acked its cancel); load B of K
    follows (a retry with the same params). A "written" for A's blocks that arrives late must
    not report B loaded: B's blocks were never written."""
    now = clock[0]
    c, a = _started_write_load({"P": True}, "P", now)
    c.mark_aborted({"r"})
    c.advance(now + 0.01)
    c.on_reply(Reply(cid=a.pieces[0].cid, status={"K": "acked"}))
    assert "r" in c.done_recving
    with c.ctx.lock:
        c.add([RecvJob(req_id="r2", key="K", mode="write", local_block_ids=[7], remote_block_ids=[],
                       host="h", port=100, remote_engine_id="P")], now + 0.02)
    c.advance(now + 0.02)
    b = c.recv["r2"]
    assert b.state is RecvState.WRITE_WAIT and b.token != a.token
    assert c.answer_written(Written(key="K", ok=True, load=a.token)) == "unknown"
    c.advance(now + 0.03)
    assert "r2" not in c.done_recving and b.written is None
    assert c.answer_written(Written(key="K", ok=True, load=b.token)) == "ok"
    c.advance(now + 0.04)
    assert "r2" in c.done_recving and "r2" not in c.failed_recving
