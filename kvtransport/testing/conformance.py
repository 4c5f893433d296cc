"""The conformance suite every backend must pass.

Parametrised by the ``kvtransport.testing.plugin`` pytest plugin over each installed
backend, each of its option sets, and two topologies (peer in this process, peer in a
child process). Every test checks what a user would check: the exact bytes arrived,
nothing else changed, the notification came once, a dead peer fails the transfer
within its deadline, bad input is refused with a typed error before any byte moves.

Invariants named (see ``docs/LIFECYCLE.md``): T1 exactly once, T2 bounded by the
deadline, T3 quiesced before reuse, T4 validated before posting.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.testing.peer import ChildProcessPeer, InProcessPeer, pattern

BLOCK = 4096
NBLOCKS = 512
SIZE = BLOCK * NBLOCKS  # 2 MiB per side: fast, yet many scattered segments
LOCAL_SEED, PEER_SEED = 1, 2


def _make_peer(case, name: str, seed: int = PEER_SEED, size: int = SIZE):
    cls = InProcessPeer if case.topology == "inproc" else ChildProcessPeer
    return cls(case.backend, dict(case.options), name, size, seed)


class Pair:
    """A local agent and a connected far side, both with one registered buffer."""

    def __init__(self, case, tag: str = "p"):
        self.case = case
        self.local = kvt.open(case.backend, name=f"local-{tag}", **case.options)
        self.buf = pattern(LOCAL_SEED, SIZE)
        self.region = self.local.register(self.buf)
        self.far = _make_peer(case, f"far-{tag}")
        self.peer = self.local.connect(self.far.metadata())
        self.far.connect(self.local.metadata())
        self.remote = self.peer.region(self.far.region_id)
        self.layout_l = kvt.BlockLayout([(self.region, 0)], BLOCK, NBLOCKS)
        self.layout_r = kvt.BlockLayout([(self.remote, 0)], BLOCK, NBLOCKS)

    def reset(self) -> None:
        self.buf[:] = pattern(LOCAL_SEED, SIZE)
        self.far.fill(PEER_SEED)
        self.local.notifications()
        self.far.notifications(0, 0)

    def close(self) -> None:
        self.far.close()
        self.local.close()


@pytest.fixture(scope="module")
def pair(kvt_case):
    p = Pair(kvt_case)
    yield p
    p.close()


@pytest.fixture
def fresh(pair):
    pair.reset()
    return pair


def _blocks(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(NBLOCKS)[:n], rng.permutation(NBLOCKS)[:n]


# -- data movement ----------------------------------------------------------------

def test_read_scattered_blocks_byte_exact(fresh):
    """READ of 200 scattered blocks: each local block equals its remote source; the
    blocks not named are untouched."""
    lids, rids = _blocks(7, 200)
    t = fresh.local.read(fresh.peer, fresh.layout_l.segments(lids), fresh.layout_r.segments(rids))
    assert t.wait(30).ok, t.status()
    remote = np.frombuffer(fresh.far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
    local = fresh.buf.reshape(NBLOCKS, BLOCK)
    assert np.array_equal(local[lids], remote[rids])
    untouched = np.setdiff1d(np.arange(NBLOCKS), lids)
    assert np.array_equal(local[untouched], pattern(LOCAL_SEED, SIZE).reshape(NBLOCKS, BLOCK)[untouched])


def test_write_scattered_blocks_byte_exact(fresh):
    lids, rids = _blocks(8, 200)
    t = fresh.local.write(fresh.peer, fresh.layout_l.segments(lids), fresh.layout_r.segments(rids))
    assert t.wait(30).ok, t.status()
    remote = np.frombuffer(fresh.far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
    assert np.array_equal(remote[rids], fresh.buf.reshape(NBLOCKS, BLOCK)[lids])
    untouched = np.setdiff1d(np.arange(NBLOCKS), rids)
    assert np.array_equal(remote[untouched], pattern(PEER_SEED, SIZE).reshape(NBLOCKS, BLOCK)[untouched])


def test_whole_region_and_contiguous_runs_merge(fresh):
    """Contiguous blocks merge into one segment; the bytes are still exact."""
    ids = np.arange(NBLOCKS)
    t = fresh.local.read(fresh.peer, fresh.layout_l.segments(ids), fresh.layout_r.segments(ids))
    assert t.wait(30).ok
    assert t.nsegments == 1
    assert fresh.buf.tobytes() == fresh.far.bytes()


def test_unaligned_odd_lengths(fresh):
    """Byte-granular segments at odd offsets, not block-aligned, arrive exactly."""
    loffs = np.array([1, 5000, 70001, SIZE - 3])
    roffs = np.array([100, 3, 200000, 9])
    lens = np.array([3, 1, 4097, 3])
    t = fresh.local.write(fresh.peer, fresh.region.segments(loffs, lens), fresh.remote.segments(roffs, lens))
    assert t.wait(30).ok, t.status()
    remote = np.frombuffer(fresh.far.bytes(), np.uint8)
    for lo, ro, ln in zip(loffs, roffs, lens):
        assert np.array_equal(remote[ro:ro + ln], fresh.buf[lo:lo + ln])


# -- notifications ------------------------------------------------------------------

def test_write_notification_arrives_once_after_data(fresh):
    lids, rids = _blocks(9, 16)
    t = fresh.local.write(fresh.peer, fresh.layout_l.segments(lids), fresh.layout_r.segments(rids),
                          notify=b"written:42")
    assert t.wait(30).ok
    got = fresh.far.notifications(1, 10)
    assert got == [(fresh.local.name, b"written:42")]
    # Data was in place when the notification was observable.
    remote = np.frombuffer(fresh.far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
    assert np.array_equal(remote[rids], fresh.buf.reshape(NBLOCKS, BLOCK)[lids])
    # Exactly once: a sentinel sent after the write is received, and no second copy of
    # the write's notification came before it.
    assert _until_sentinel(fresh) == []


def _until_sentinel(p: "Pair") -> list[tuple[str, bytes]]:
    """Send a sentinel notification and return what the far side received before it."""
    p.local.send_notification(p.peer, b"sentinel")
    got: list[tuple[str, bytes]] = []
    while (p.local.name, b"sentinel") not in got:
        more = p.far.notifications(1, 10)
        assert more, f"sentinel notification not received; got {got}"
        got += more
    return got[:got.index((p.local.name, b"sentinel"))]


def test_read_notification_reaches_the_data_owner(fresh):
    lids, rids = _blocks(10, 16)
    t = fresh.local.read(fresh.peer, fresh.layout_l.segments(lids), fresh.layout_r.segments(rids),
                         notify=b"read:7")
    assert t.wait(30).ok
    assert fresh.far.notifications(1, 10) == [(fresh.local.name, b"read:7")]


def test_standalone_notification(fresh):
    fresh.local.send_notification(fresh.peer, b"hello")
    assert fresh.far.notifications(1, 10) == [(fresh.local.name, b"hello")]


def test_peer_initiated_write_and_notification(fresh):
    """The far side initiates (the other direction of the same connection)."""
    state = fresh.far.call("write_to_peer", 0, BLOCK, 3 * BLOCK, b"from-far")
    assert state == "DONE"
    far = np.frombuffer(fresh.far.bytes(0, 3 * BLOCK), np.uint8)
    assert np.array_equal(fresh.buf[BLOCK:4 * BLOCK], far)
    limit = time.monotonic() + 10
    got = []
    while not got and time.monotonic() < limit:
        got = fresh.local.notifications()
        time.sleep(0.005)
    assert [(n.peer, n.payload) for n in got] == [(fresh.far.name, b"from-far")]


# -- lifecycle: exactly once, deadlines ----------------------------------------------------

def test_exactly_once_completion_T1(fresh):
    ts = []
    for i in range(20):
        lids, rids = _blocks(100 + i, 4)
        ts.append(fresh.local.read(fresh.peer, fresh.layout_l.segments(lids), fresh.layout_r.segments(rids)))
    for t in ts:
        assert t.wait(30).ok
    seen = fresh.local.progress() + fresh.local.progress()
    assert sorted(t.id for t in seen if t in ts) == sorted(t.id for t in ts)
    assert all(t.status().ok for t in ts)  # stable after the fact
    for t in ts:
        t.release()


def test_caller_spinning_on_status_does_not_starve_the_transfer(fresh):
    """``while not t.status().done: pass`` must let the backend finish the transfer.

    A backend that moves bytes on Python threads needs the GIL between native calls, and
    a caller spinning on ``status()`` takes it back at once each turn (the core yields it
    once the same pending transfer has been polled many times in a row, microseconds apart:
    ``kvtransport.transfer.SPIN_POLLS_BEFORE_YIELD``). CPython's forced switch is pushed
    out of reach while spinning (``sys.setswitchinterval``), so the transfer finishes only
    if polling lets those threads run. The spin ends at the transfer's deadline at the
    latest (T2); nothing is timed."""
    ids = np.arange(NBLOCKS)
    t = fresh.local.write(fresh.peer, fresh.layout_l.segments(ids), fresh.layout_r.segments(ids), timeout=30)
    old = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        while not t.status().done:
            pass
    finally:
        sys.setswitchinterval(old)
    assert t.status().ok, t.status()
    assert fresh.far.bytes() == fresh.buf.tobytes()


def test_deadline_bounds_a_silent_transfer_T2(kvt_case):
    """A transfer the backend never completes (injected hang) is FAILED by its deadline."""
    local = kvt.open(kvt_case.backend, name="local-hang", faults=kvt.FaultPlan(hang_rate=1.0),
                     **kvt_case.options)
    far = _make_peer(kvt_case, "far-hang")
    try:
        buf = np.zeros(SIZE, np.uint8)
        r = local.register(buf)
        peer = local.connect(far.metadata())
        t = local.read(peer, r.segments([0], [BLOCK]), peer.region(far.region_id).segments([0], [BLOCK]),
                       timeout=0.3)
        st = t.wait(10)
        assert st.state is kvt.State.FAILED and "deadline" in st.reason
        assert st.quiesced  # nothing was posted, so nothing can land (T3)
        # Failed by its deadline, not before it (a deadline fact, no wall-clock bound).
        assert t.finished_at is not None and t.finished_at >= t.deadline
        assert [x.id for x in local.progress()] == [t.id]
        assert local.progress() == []
    finally:
        far.close()
        local.close()


def test_injected_failure_moves_nothing(kvt_case):
    local = kvt.open(kvt_case.backend, name="local-fail", faults=kvt.FaultPlan(fail_rate=1.0),
                     **kvt_case.options)
    far = _make_peer(kvt_case, "far-fail")
    try:
        buf = np.zeros(SIZE, np.uint8)
        r = local.register(buf)
        peer = local.connect(far.metadata())
        t = local.read(peer, r.whole(), peer.region(far.region_id).whole())
        assert t.wait(10).state is kvt.State.FAILED
        assert not buf.any()
    finally:
        far.close()
        local.close()


# -- bad input (T4): typed error, nothing moved, agent still serves --------------------------

def _assert_untouched(p: Pair) -> None:
    assert np.array_equal(p.buf, pattern(LOCAL_SEED, SIZE))
    assert p.far.bytes() == pattern(PEER_SEED, SIZE).tobytes()


def test_bad_input_is_refused_before_any_byte_moves(fresh):
    p = fresh
    ok_l, ok_r = p.region.segments([0], [BLOCK]), p.remote.segments([0], [BLOCK])
    cases = [
        (errors.InvalidSegmentsError, p.region.segments([SIZE - 10], [BLOCK]), ok_r),      # out of range
        (errors.InvalidSegmentsError, ok_l, p.remote.segments([SIZE], [1])),               # remote out of range
        (errors.UnregisteredMemoryError, kvt.Segments(9999, 0, BLOCK), ok_r),              # unregistered local
        (errors.UnregisteredMemoryError, ok_l, kvt.Segments(9999, 0, BLOCK)),              # unknown remote region
        (errors.InvalidSegmentsError, p.region.segments([0], [BLOCK]), p.remote.segments([0], [BLOCK - 1])),
        (errors.InvalidSegmentsError, p.region.segments([0, BLOCK], [BLOCK]), ok_r),       # count mismatch
        (errors.InvalidSegmentsError, p.region.segments([0], [0]), p.remote.segments([0], [0])),
    ]
    for exc, loc, rem in cases:
        for op in (p.local.read, p.local.write):
            with pytest.raises(exc):
                op(p.peer, loc, rem)
    with pytest.raises(errors.InvalidSegmentsError):
        kvt.Segments(p.region.id, [-1], [BLOCK])
    _assert_untouched(p)
    assert p.local.stats()["transfers_posted"] == 0 or p.local.pending() == 0
    # Still serving.
    assert p.local.read(p.peer, ok_l, ok_r).wait(30).ok


def test_unknown_and_disconnected_peer(kvt_case):
    p = Pair(kvt_case, "disc")
    try:
        seg_l, seg_r = p.region.segments([0], [BLOCK]), p.remote.segments([0], [BLOCK])
        p.local.disconnect(p.peer)
        with pytest.raises(errors.UnknownPeerError):
            p.local.read(p.peer, seg_l, seg_r)
        peer2 = p.local.connect(p.far.metadata())
        assert p.local.read(peer2, seg_l, peer2.region(p.far.region_id).segments([0], [BLOCK])).wait(30).ok
    finally:
        p.close()


def test_closed_agent_raises_typed_error(kvt_case):
    p = Pair(kvt_case, "closed")
    seg_l, seg_r = p.region.segments([0], [BLOCK]), p.remote.segments([0], [BLOCK])
    p.far.close()
    p.local.close()
    for call in (lambda: p.local.read(p.peer, seg_l, seg_r), p.local.metadata,
                 lambda: p.local.register(np.zeros(8, np.uint8))):
        with pytest.raises(errors.AgentClosedError):
            call()
    p.local.close()  # idempotent


def test_malformed_metadata_refused_agent_keeps_serving(fresh):
    good = fresh.far.metadata()
    bad = [b"", b"\x00" * 10, good[:-5], good + b"x" * 8, b"\xff" * 64]
    for blob in bad:
        with pytest.raises(errors.PeerMetadataError):
            fresh.local.connect(blob)
    with kvt.open(fresh.case.backend, name="tiny-cap", max_metadata_bytes=16, **fresh.case.options) as tiny:
        with pytest.raises(errors.PeerMetadataError):
            tiny.connect(good)
    t = fresh.local.read(fresh.peer, fresh.region.segments([0], [BLOCK]), fresh.remote.segments([0], [BLOCK]))
    assert t.wait(30).ok


# -- peer failure ----------------------------------------------------------------------------

def test_dead_peer_fails_within_deadline_others_still_served(kvt_case):
    """Kill the peer (SIGKILL in xproc, close in inproc): transfers to it end FAILED by
    their deadline (T2); the agent keeps serving a second, healthy peer."""
    local = kvt.open(kvt_case.backend, name="local-dead", **kvt_case.options)
    victim = _make_peer(kvt_case, "far-victim")
    healthy = _make_peer(kvt_case, "far-healthy", seed=5)
    try:
        buf = np.zeros(SIZE, np.uint8)
        r = local.register(buf)
        pv = local.connect(victim.metadata())
        ph = local.connect(healthy.metadata())
        if isinstance(victim, ChildProcessPeer):
            victim.kill()
        else:
            victim.close()
            local.disconnect(pv)  # in one process "death" is the peer leaving
            pv = None
        if pv is not None:
            try:
                t = local.read(pv, r.whole(), pv.region(victim.region_id).whole(), timeout=3.0)
            except errors.KVTransportError:
                pass  # refusing to post to a known-dead peer is also correct
            else:
                # Ends FAILED: at the latest by its deadline (the core fails a silent
                # transfer then), earlier if the backend sees the peer gone.
                st = t.wait(20)
                assert st.state is kvt.State.FAILED, st
                assert t.finished_at is not None
        t = local.read(ph, r.whole(), ph.region(healthy.region_id).whole())
        assert t.wait(30).ok
        assert buf.tobytes() == healthy.bytes()
    finally:
        victim.close()
        healthy.close()
        local.close()


def test_restarted_peer_replaces_the_old_connection(kvt_case):
    local = kvt.open(kvt_case.backend, name="local-restart", **kvt_case.options)
    first = _make_peer(kvt_case, "far-restart", seed=11)
    try:
        buf = np.zeros(SIZE, np.uint8)
        r = local.register(buf)
        p1 = local.connect(first.metadata())
        first.close()
        second = _make_peer(kvt_case, "far-restart", seed=12)
        try:
            p2 = local.connect(second.metadata())
            with pytest.raises(errors.UnknownPeerError):
                local.read(p1, r.whole(), p2.region(second.region_id).whole())
            assert local.read(p2, r.whole(), p2.region(second.region_id).whole()).wait(30).ok
            assert buf.tobytes() == pattern(12, SIZE).tobytes()
        finally:
            second.close()
    finally:
        local.close()
