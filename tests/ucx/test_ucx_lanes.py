"""Lanes: the ucx backend shares a large transfer among several UCP workers so two threads
copy at once. What a user must be able to rely on: every byte lands exactly once wherever the
lane boundaries fall (inside a segment, between segments, with ragged sizes), READ and WRITE,
in one process and across two, on every transport; the notification comes after all lanes'
data; and the split really happens (each lane carried bytes)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport.errors import BackendOptionError
from kvtransport.testing.pinning import call_on_one_cpu
from kvtransport_ucx.datapath import cut as _cut
from ucx_helpers import (
    SENTINEL,
    TLS_OPTIONS,
    PeerProcess,
    expected_bytes,
    notes_until,
    sha,
    skip_unless_ucx_usable,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _need_ucx():
    skip_unless_ucx_usable()


def _expand(la, ra, ln) -> np.ndarray:
    """Every byte a segment list moves, as (local address, remote address) rows."""
    rows = [np.stack([np.arange(a, a + n), np.arange(b, b + n)], 1) for a, b, n in zip(la, ra, ln)]
    return np.concatenate(rows) if rows else np.zeros((0, 2), np.int64)


@pytest.mark.parametrize("seed", range(30))
def test_cut_moves_every_byte_exactly_once(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    ln = rng.integers(1, 50, n).astype(np.uint64)
    la = (rng.permutation(100)[:n] * 64).astype(np.uint64)
    ra = (rng.permutation(100)[:n] * 64 + 7).astype(np.uint64)
    reg = np.arange(n, dtype=np.int64)
    total = int(ln.sum())
    at = int(rng.integers(1, total)) if total > 1 else 1
    if at >= total:
        pytest.skip("a one-byte transfer cannot be cut")
    (hla, hra, hln, hlr, hrr), (tla, tra, tln, tlr, trr) = _cut((la, ra, ln, reg, reg), at)
    assert int(hln.sum()) == at and int(tln.sum()) == total - at
    assert (hln > 0).all() and (tln > 0).all()
    whole = _expand(la, ra, ln)
    parts = np.concatenate([_expand(hla, hra, hln), _expand(tla, tra, tln)])
    assert np.array_equal(whole, parts)  # same bytes, same order, nothing twice
    assert len(hlr) == len(hla) and len(tlr) == len(tla)  # region arrays follow the cut
    assert np.array_equal(_expand(la, ra, ln), whole)  # the caller's arrays were not modified


@pytest.mark.parametrize("opts", [{"lanes": 0}, {"lanes": 9}, {"lanes": 1.5}, {"lane_split_bytes": -1},
                                  {"inline_progress_s": 2}])
def test_bad_lane_options_are_refused(opts):
    with pytest.raises(BackendOptionError) as ei:
        kvt.open("ucx", name="bad-lanes", **opts)
    assert list(opts)[0] in str(ei.value)


def test_an_agent_opened_on_one_cpu_has_one_lane_by_default_and_still_moves_every_byte():
    """Inside an engine pinned to one core every thread shares that core, so a second lane
    cannot copy in parallel and only adds hand-offs (two processes pinned to one core each:
    16 MiB over shm 0.79x NIXL with two lanes, docs/UCX.md). An explicit ``lanes`` wins."""
    n = 3 << 20  # above lane_split_bytes: two lanes would share it
    src = np.frombuffer(np.random.default_rng(3).bytes(n), np.uint8).copy()
    dst = np.zeros(n, np.uint8)

    def pinned() -> tuple[int, int, int]:
        with kvt.open("ucx", name="one-cpu-a", tls="shm") as a, kvt.open("ucx", name="one-cpu-b", tls="shm") as b:
            ra, rb = a.register(dst), b.register(src)
            peer = a.connect(b.metadata())
            assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
            with kvt.open("ucx", name="one-cpu-c", tls="shm", lanes=2) as c:
                return a.describe()["lanes"], b.describe()["lanes"], c.describe()["lanes"]

    assert call_on_one_cpu(pinned) == (1, 1, 2)
    assert dst.tobytes() == src.tobytes()
    with kvt.open("ucx", name="all-cpus", tls="shm") as d:
        assert d.describe()["lanes"] == min(2, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("tls, size, split", [("shm", 4 << 20, False), ("shm", 12 << 20, True),
                                              ("tcp", 4 << 20, True), ("tcp", 1 << 20, False)])
def test_default_split_size_is_larger_for_cma_copies_than_over_the_network(tls, size, split):
    """With cma a lane thread's hand-off costs more than it saves below 8 MiB (one 4 MiB READ
    between two processes: 338 us split, 225 us on lane 0); over tcp a READ gains from 4 MiB
    on, so the network threshold stays 2 MiB. ``bytes_per_lane`` shows where the bytes went."""
    rng = np.random.default_rng(size + len(tls))
    src, dst = rng.integers(0, 256, size, dtype=np.uint8), np.zeros(size, np.uint8)
    with kvt.open("ucx", name=f"auto-split-a-{tls}", tls=tls, lanes=2) as a, \
            kvt.open("ucx", name=f"auto-split-b-{tls}", tls=tls, lanes=2) as b:
        ra, rb = a.register(dst), b.register(src)
        peer = a.connect(b.metadata())
        assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(60).ok
        per_lane = a.describe()["bytes_per_lane"]
    assert dst.tobytes() == src.tobytes()
    assert sum(per_lane) == size
    assert (per_lane[1] > 0) is split, per_lane


@pytest.mark.parametrize("tls", [o["tls"] for o in TLS_OPTIONS])
@pytest.mark.parametrize("lanes", [2, 3])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_split_transfer_in_one_process_is_byte_exact(tls, lanes, op):
    rng = np.random.default_rng(lanes * 10 + (op == "READ"))
    size = 8 << 20
    mine, theirs = np.zeros(size, np.uint8), rng.integers(0, 256, size, dtype=np.uint8)
    if op == "WRITE":
        mine, theirs = theirs, np.zeros(size, np.uint8)
    i = kvt.open("ucx", name=f"lanes-i-{tls}-{lanes}", tls=tls, lanes=lanes, lane_split_bytes=0)
    t = kvt.open("ucx", name=f"lanes-t-{tls}-{lanes}", tls=tls)
    try:
        ri, rt = i.register(mine), t.register(theirs)
        p = i.connect(t.metadata())
        t.connect(i.metadata())
        # 97 ragged segments in shuffled order: lane boundaries fall inside segments
        n = 97
        ln = rng.integers(1, 60_000, n).astype(np.int64)
        starts = np.cumsum(np.concatenate([[0], ln[:-1] + 13]))
        order = rng.permutation(n)
        lo, ro, ln = starts[order], (size - starts - ln)[order], ln[order]
        before = (mine.copy(), theirs.copy())
        fn = i.read if op == "READ" else i.write
        tr = fn(p, ri.segments(lo, ln), p.region(rt.id).segments(ro, ln), notify=b"all-lanes-done", timeout=60)
        st = tr.wait()
        assert st.ok, st.reason
        src, dst = (theirs, mine) if op == "READ" else (mine, theirs)
        so, do = (ro, lo) if op == "READ" else (lo, ro)
        expect = (before[0] if op == "READ" else before[1]).copy()
        for s, d, n_ in zip(so, do, ln):
            expect[d : d + n_] = src[s : s + n_]
        assert np.array_equal(dst, expect)  # every segment landed, nothing else changed
        per_lane = i.describe()["bytes_per_lane"]
        assert len(per_lane) == lanes and all(b > 0 for b in per_lane), per_lane
        assert sum(per_lane) == int(ln.sum())
        i.send_notification(p, SENTINEL)  # after the transfer's: arrives after it
        assert notes_until(t) == [(i.name, b"all-lanes-done"), (i.name, SENTINEL)]
    finally:
        i.close()
        t.close()


@pytest.mark.parametrize("opts", TLS_OPTIONS, ids=lambda o: o["tls"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_split_transfer_across_processes_is_byte_exact(opts, op):
    size = 24 << 20
    peer = PeerProcess("lanes-peer", size, seed=21, options=opts)
    agent = kvt.open("ucx", name="lanes-local", lanes=2, **opts)
    try:
        buf = np.zeros(size, np.uint8)
        region = agent.register(buf)
        p = agent.connect(peer.metadata)
        assert peer.call(cmd="connect", md=agent.metadata().hex()) == {"ok": True}
        theirs = expected_bytes(size, 21)
        block = 1 << 20
        src = np.random.default_rng(3).permutation(size // block).astype(np.int64) * block
        dst = np.arange(size // block, dtype=np.int64) * block
        ln = np.full(len(src), block, np.int64)
        t = agent.read(p, region.segments(dst, ln), p.regions[0].segments(src, ln), timeout=60)
        assert t.wait().ok
        for s, d in zip(src, dst):
            assert np.array_equal(buf[d : d + block], theirs[s : s + block])
        if op == "WRITE":
            buf[:] = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8)
            t = agent.write(p, region.segments(dst, ln), p.regions[0].segments(src, ln), notify=b"w", timeout=60)
            assert t.wait().ok
            agent.send_notification(p, SENTINEL)
            assert peer.notes_until() == [["lanes-local", b"w".hex()], ["lanes-local", SENTINEL.hex()]]
            got = peer.call(cmd="sha", offsets=src.tolist(), lengths=ln.tolist())
            assert got["sha"] == sha(buf, dst, ln)
    finally:
        peer.close()
        agent.close()


@pytest.mark.parametrize("mine, theirs", [(3, 1), (1, 3), (2, 4)])
def test_agents_with_different_lane_counts_interoperate(mine, theirs):
    """Our lane k connects to the peer's lane k modulo its lane count; both directions move
    every byte, and notifications (always lane 0 to lane 0) arrive."""
    size = 6 << 20
    rng = np.random.default_rng(mine * 7 + theirs)
    x, y = rng.integers(0, 256, size, dtype=np.uint8), np.zeros(size, np.uint8)
    a = kvt.open("ucx", name=f"mix-a{mine}", tls="tcp", lanes=mine, lane_split_bytes=0)
    b = kvt.open("ucx", name=f"mix-b{theirs}", tls="tcp", lanes=theirs, lane_split_bytes=0)
    try:
        ra, rb = a.register(x), b.register(y)
        pa, pb = a.connect(b.metadata()), b.connect(a.metadata())
        seg = np.array([0], np.int64), np.array([size], np.int64)
        assert a.write(pa, ra.segments(*seg), pa.region(rb.id).segments(*seg), notify=b"w").wait().ok
        assert np.array_equal(x, y)
        y[:] = rng.integers(0, 256, size, dtype=np.uint8)
        assert b.write(pb, rb.segments(*seg), pb.region(ra.id).segments(*seg), notify=b"w2").wait().ok
        assert np.array_equal(x, y)
        a.send_notification(pa, SENTINEL)
        b.send_notification(pb, SENTINEL)
        assert [p for _, p in notes_until(b)] == [b"w", SENTINEL]
        assert [p for _, p in notes_until(a)] == [b"w2", SENTINEL]
    finally:
        a.close()
        b.close()


def test_peer_exporting_a_single_address_is_reached_on_every_lane():
    """A peer whose blob lists no lane addresses (older kvtransport) is reached through its one
    address from all our lanes."""
    import msgspec

    from kvtransport_ucx import wire as B

    size = 4 << 20
    a = kvt.open("ucx", name="old-style-a", tls="tcp", lanes=2, lane_split_bytes=0)
    b = kvt.open("ucx", name="old-style-b", tls="tcp", lanes=2)
    try:
        x, y = np.arange(size, dtype=np.uint32).view(np.uint8)[:size].copy(), np.zeros(size, np.uint8)
        ra, rb = a.register(x), b.register(y)
        blob = b._backend.export()
        exp = msgspec.msgpack.decode(blob, type=B.UcxBlob)
        assert len(exp.lane_addresses) == 2
        old = msgspec.structs.replace(exp, lane_addresses=[])
        b._backend.export = lambda: msgspec.msgpack.encode(old)
        pa = a.connect(b.metadata())
        seg = np.array([0], np.int64), np.array([size], np.int64)
        assert a.write(pa, ra.segments(*seg), pa.region(rb.id).segments(*seg)).wait().ok
        assert np.array_equal(x, y)
        assert all(n > 0 for n in a.describe()["bytes_per_lane"])
    finally:
        a.close()
        b.close()



class _Pair:
    """Agent ``a`` (every transfer split over its lanes) connected to agent ``b``, and a WRITE
    of all of ``x`` (registered on a) into ``y`` (registered on b)."""

    def __init__(self, name: str, tls: str, lanes: int, size: int, seed: int) -> None:
        self.x = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        self.y = np.zeros(size, np.uint8)
        self.a = kvt.open("ucx", name=f"{name}-a", tls=tls, lanes=lanes, lane_split_bytes=0)
        self.b = kvt.open("ucx", name=f"{name}-b", tls=tls, lanes=lanes)
        self.ra, self.rb = self.a.register(self.x), self.b.register(self.y)
        self.peer = self.a.connect(self.b.metadata())
        self._seg = np.array([0], np.int64), np.array([size], np.int64)

    def write(self, **kw):
        src = self.ra.segments(*self._seg)
        return self.a.write(self.peer, src, self.peer.region(self.rb.id).segments(*self._seg), timeout=30, **kw)

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.mark.parametrize("tls", ["tcp", "shm"])
def test_each_lane_share_is_posted_by_that_lane_s_thread(tls, monkeypatch):
    """Over tcp a post *sends* (UCX writes what the socket takes inside the call), so the
    posting thread must not post every lane's share itself: lane k's share is posted by lane
    k's progress thread, lane 0's by the caller, and the bytes are still exact."""
    from kvtransport_ucx import datapath as T

    seen: list[tuple[int, str]] = []
    real = T.DataPath._post_lane

    def spy(self, x, lane, *args):
        seen.append((lane.index, threading.current_thread().name))
        return real(self, x, lane, *args)

    monkeypatch.setattr(T.DataPath, "_post_lane", spy)
    p = _Pair(f"who-posts-{tls}", tls, 3, 6 << 20, 11)
    try:
        assert p.write().wait().ok
        assert np.array_equal(p.x, p.y)
        me = threading.current_thread().name
        assert sorted(seen) == [(0, me), (1, f"kvt-ucx-progress-who-posts-{tls}-a-1"),
                                (2, f"kvt-ucx-progress-who-posts-{tls}-a-2")], seen
    finally:
        p.close()


def _until_untracked(agent) -> None:
    """Wait (bounded) until the agent's ucx data path tracks no transfer; assert it."""
    data = agent._backend._data
    deadline = time.monotonic() + 10
    while data.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not data.active, f"{len(data.active)} transfers still tracked"


@pytest.mark.parametrize("end", ["disconnect", "close"])
def test_split_transfers_cut_short_while_lanes_post_all_end_and_leave_nothing_behind(end):
    """Transfers whose shares are still queued for, or being posted by, the lane threads when
    their peer is disconnected or the agent closes: every one ends (DONE or FAILED), none is
    left tracked, nothing crashes, and after a disconnect the next transfer is exact."""
    p = _Pair(f"cut-{end}", "tcp", 3, 32 << 20, 12)
    try:
        ts = [p.write() for _ in range(8)]
        if end == "disconnect":
            p.a.disconnect(p.peer)
        else:
            p.a.close()
        for t in ts:
            assert t.wait(20).done, "a transfer outlived the end of its peer's connection"
        _until_untracked(p.a)
        if end == "disconnect":
            p.peer = p.a.connect(p.b.metadata())
            p.y[:] = 0
            assert p.write().wait().ok
            assert np.array_equal(p.x, p.y)
    finally:
        p.close()


@pytest.mark.parametrize("lane", [0, 1])
def test_a_share_whose_post_raises_fails_its_transfer_instead_of_stranding_it(lane, monkeypatch):
    """If posting one lane's share raises (a bug, a library refusing), the transfer must not
    wait for that share forever: it ends FAILED naming the lane, quiesced once the other
    shares' bytes landed, nothing stays tracked, and the agent keeps working."""
    from kvtransport_ucx import datapath as T

    real = T.DataPath._post_lane
    armed = [True]

    def boom(self, x, ln_, *args):
        if ln_.index == lane and armed[0]:
            raise RuntimeError("injected posting failure")
        return real(self, x, ln_, *args)

    monkeypatch.setattr(T.DataPath, "_post_lane", boom)
    p = _Pair(f"boom-{lane}", "tcp", 2, 6 << 20, 13)
    try:
        t = p.write()
        st = t.wait(20)
        assert st.done and not st.ok
        assert f"posting on lane {lane} failed" in st.reason and "injected" in st.reason, st.reason
        deadline = time.monotonic() + 10
        while not t.status().quiesced and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.status().quiesced
        t.release()
        _until_untracked(p.a)
        armed[0] = False
        assert p.write().wait().ok
        assert np.array_equal(p.x, p.y)
    finally:
        p.close()
