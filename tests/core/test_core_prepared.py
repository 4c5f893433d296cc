"""``Agent.prepare`` once, ``Agent.post`` many times (issue 12.7): the analogue of NIXL's
prepared handles. Posting skips the range checks and merging and re-checks only what
can have changed (peer replaced or disconnected, local region deregistered, agent
closed), with a typed error naming the fix. Real loopback backend, two agents in this
process.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.spi import Op

BLOCK, NBLK = 256, 64


@pytest.fixture
def pair():
    a = kvt.open("loopback", name="pp-a")
    b = kvt.open("loopback", name="pp-b")
    dst = np.zeros(NBLK * BLOCK, np.uint8)
    src = np.zeros(NBLK * BLOCK, np.uint8)
    ra, rb = a.register(dst), b.register(src)
    b.connect(a.metadata())
    peer = a.connect(b.metadata())
    lay_l = kvt.BlockLayout([(ra, 0)], BLOCK, NBLK)
    lay_r = kvt.BlockLayout([(peer.region(rb.id), 0)], BLOCK, NBLK)
    yield a, b, ra, rb, peer, lay_l, lay_r, dst, src
    a.close()
    b.close()


def _notes(agent: kvt.Agent, n: int) -> list[bytes]:
    got: list = []
    limit = time.monotonic() + 10  # hang guard only
    while len(got) < n and time.monotonic() < limit:
        got += agent.notifications()
        time.sleep(0.002)
    return [x.payload for x in got]


def test_prepared_transfer_posted_many_times_moves_the_current_bytes(pair):
    a, b, ra, rb, peer, lay_l, lay_r, dst, src = pair
    rng = np.random.default_rng(3)
    lids, rids = rng.permutation(NBLK)[:40], rng.permutation(NBLK)[:40]
    p = a.prepare(Op.READ, peer, lay_l.segments(lids), lay_r.segments(rids), notify=b"default")
    assert isinstance(p, kvt.PreparedTransfer)
    assert (p.op, p.peer, p.nbytes, p.caller_segments) == (Op.READ, peer, 40 * BLOCK, 40)
    assert all(not arr.flags.writeable for arr in (p.request.local_addr, p.request.remote_addr,
                                                   p.request.length))  # shared by every post
    ids = []
    for k, note in enumerate([None, b"second", b"third"]):
        src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)  # new content each round
        t = a.post(p, notify=note)
        assert t.wait(10).ok
        ids.append(t.id)
        got, want = dst.reshape(NBLK, BLOCK), src.reshape(NBLK, BLOCK)
        assert np.array_equal(got[lids], want[rids]), f"round {k}"
    assert len(set(ids)) == 3
    assert _notes(b, 3) == [b"default", b"second", b"third"]
    s = a.stats()
    assert (s["transfers_posted"], s["transfers_done"], s["segments_posted"]) == (3, 3, 120)


def test_post_timeout_overrides_the_prepared_default():
    a = kvt.open("loopback", name="pt-a", faults=kvt.FaultPlan(hang_rate=1.0))
    b = kvt.open("loopback", name="pt-b")
    try:
        ra, rb = a.register(np.zeros(64, np.uint8)), b.register(np.zeros(64, np.uint8))
        b.connect(a.metadata())
        peer = a.connect(b.metadata())
        p = a.prepare(Op.WRITE, peer, ra.whole(), peer.region(rb.id).whole(), timeout=30)
        t = a.post(p, timeout=0.2)
        assert t.deadline - t.posted_at < 30
        st = t.wait(10)
        assert st.state is kvt.State.FAILED and "deadline of 0.2" in st.reason
        assert t.finished_at >= t.deadline
        with pytest.raises(errors.InvalidSegmentsError, match="timeout"):
            a.post(p, timeout=float("nan"))
        with pytest.raises(errors.InvalidSegmentsError, match="notify must be bytes"):
            a.post(p, notify="text")
    finally:
        a.close()
        b.close()


def test_post_refuses_a_prepared_transfer_whose_peer_was_replaced_or_disconnected(pair):
    a, b, ra, rb, peer, lay_l, lay_r, dst, src = pair
    p = a.prepare(Op.READ, peer, lay_l.segments([0, 1]), lay_r.segments([2, 3]))
    assert a.post(p).wait(10).ok
    newer = a.connect(b.metadata())  # a fresh connect replaces the Peer object
    with pytest.raises(errors.StalePreparedTransferError, match="replaced by a newer connect"):
        a.post(p)
    p2 = a.prepare(Op.READ, newer, lay_l.segments([0]), kvt.BlockLayout(
        [(newer.region(rb.id), 0)], BLOCK, NBLK).segments([5]))
    assert a.post(p2).wait(10).ok
    a.disconnect(newer)
    with pytest.raises(errors.StalePreparedTransferError, match="disconnected"):
        a.post(p2)
    assert a.stats()["transfers_posted"] == 2  # refusals post nothing


def test_post_refuses_after_a_used_region_was_deregistered_not_an_unrelated_one(pair):
    a, b, ra, rb, peer, lay_l, lay_r, dst, src = pair
    other = a.register(np.zeros(128, np.uint8))
    p = a.prepare(Op.READ, peer, lay_l.segments([7]), lay_r.segments([9]))
    src[9 * BLOCK:10 * BLOCK] = 42
    a.deregister(other)  # the generation moved, but p's region is still there
    assert a.post(p).wait(10).ok
    assert (dst[7 * BLOCK:8 * BLOCK] == 42).all()
    a.deregister(ra)
    with pytest.raises(errors.StalePreparedTransferError, match=f"region\\(s\\) \\[{ra.id}\\]"):
        a.post(p)
    # Registering the memory again gives a new region id: the old preparation stays stale.
    a.register(dst)
    with pytest.raises(errors.StalePreparedTransferError, match="prepare again"):
        a.post(p)


def test_post_refuses_foreign_or_closed(pair):
    a, b, ra, rb, peer, lay_l, lay_r, dst, src = pair
    p = a.prepare(Op.READ, peer, lay_l.segments([0]), lay_r.segments([0]))
    other = kvt.open("loopback", name="pp-other")
    try:
        with pytest.raises(errors.StalePreparedTransferError, match="another agent"):
            other.post(p)
        with pytest.raises(errors.InvalidSegmentsError, match="Agent.prepare"):
            a.post(p.request)  # the SPI request is not a preparation
    finally:
        other.close()
    a.close()
    with pytest.raises(errors.AgentClosedError):
        a.post(p)


def test_prepare_raises_what_read_raises_and_posts_nothing(pair):
    a, b, ra, rb, peer, lay_l, lay_r, dst, src = pair
    bad = ra.segments([NBLK * BLOCK - 8], [16])
    with pytest.raises(errors.InvalidSegmentsError, match="outside region"):
        a.prepare(Op.READ, peer, bad, peer.region(rb.id).segments([0], [16]))
    assert a.stats()["transfers_posted"] == 0 and a.pending() == 0
