"""The moriio backend under the real core (``kvt.open("moriio")``), on a FAKE mori.io.

Proves the glue end to end through the public API a user calls (the core validates,
merges, enforces deadlines; the backend translates to mori); the fake moves bytes with
memmove in this process, so the byte checks test our offsets and directions, not RDMA.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors

from .fake_mori_io import PeerFailureReason, make_fake_mori_io

BLOCK = 256
NBLOCKS = 64
LAYERS = 3


def _cache(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK * NBLOCKS, dtype=np.uint8) for _ in range(LAYERS)]


class Engines:
    """A prefill and a decode agent on one fake fabric, with a 3-layer paged KV cache each."""

    def __init__(self, io, **core):
        from kvtransport_moriio.backend import using_mori_module

        self._seam = using_mori_module(io)
        self._seam.__enter__()
        self.io = io
        self.p = kvt.open("moriio", name="prefill", host="127.0.0.1", **core)
        self.d = kvt.open("moriio", name="decode", host="127.0.0.1", **core)
        self.kv_p, self.kv_d = _cache(1), _cache(2)
        self.rp = [self.p.register(x) for x in self.kv_p]
        self.rd = [self.d.register(x) for x in self.kv_d]
        self.peer_of_d = self.d.connect(self.p.metadata())  # decode's view of prefill
        self.peer_of_p = self.p.connect(self.d.metadata())
        remote = [self.peer_of_d.region(r.id) for r in self.rp]
        self.lay_d = kvt.BlockLayout([(r, 0) for r in self.rd], BLOCK, NBLOCKS)
        self.lay_p_remote = kvt.BlockLayout([(r, 0) for r in remote], BLOCK, NBLOCKS)
        remote_d = [self.peer_of_p.region(r.id) for r in self.rd]
        self.lay_p = kvt.BlockLayout([(r, 0) for r in self.rp], BLOCK, NBLOCKS)
        self.lay_d_remote = kvt.BlockLayout([(r, 0) for r in remote_d], BLOCK, NBLOCKS)

    def close(self):
        self.d.close()
        self.p.close()
        self._seam.__exit__(None, None, None)


@pytest.fixture
def engines():
    e = Engines(make_fake_mori_io())
    yield e
    e.close()


@pytest.fixture
def slow_engines():
    e = Engines(make_fake_mori_io(mode="deferred"), default_timeout_s=0.3)
    yield e
    e.close()


def _notes(agent, n=1, timeout=5.0):
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += agent.notifications()
        time.sleep(0.002)
    return out


def test_read_scattered_blocks_byte_exact_fake_mori(engines):
    e = engines
    src = np.array([5, 6, 7, 40, 3, 63, 0])  # runs (5,6,7) merge; the rest scatter
    dst = np.array([10, 11, 12, 2, 50, 1, 63])
    before = [x.copy() for x in e.kv_d]
    t = e.d.read(e.peer_of_d, e.lay_d.segments(dst), e.lay_p_remote.segments(src), notify=b"req-1 read")
    st = t.wait(5)
    assert st.ok, st.reason
    for layer in range(LAYERS):
        expect = before[layer].reshape(NBLOCKS, BLOCK).copy()
        expect[dst] = e.kv_p[layer].reshape(NBLOCKS, BLOCK)[src]
        assert np.array_equal(e.kv_d[layer].reshape(NBLOCKS, BLOCK), expect), f"layer {layer}"
    assert _notes(e.p) == [kvt.Notification("decode", b"req-1 read")]
    # One mori batch per (local layer, remote layer) pair; the core merged the run 5,6,7.
    batches = e.io.fabric.batches
    assert len(batches) == LAYERS
    assert all(len(b.sizes) == 5 for b in batches) and all(b.sizes[0] == 3 * BLOCK for b in batches)


def test_write_scattered_blocks_byte_exact_fake_mori(engines):
    e = engines
    src = np.arange(0, 64, 4)
    dst = np.arange(63, -1, -4)
    before_p = [x.copy() for x in e.kv_p]
    before_d = [x.copy() for x in e.kv_d]
    t = e.p.write(e.peer_of_p, e.lay_p.segments(src), e.lay_d_remote.segments(dst), notify=b"req-2 written")
    assert t.wait(5).ok
    for layer in range(LAYERS):
        expect = before_d[layer].reshape(NBLOCKS, BLOCK).copy()
        expect[dst] = before_p[layer].reshape(NBLOCKS, BLOCK)[src]
        assert np.array_equal(e.kv_d[layer].reshape(NBLOCKS, BLOCK), expect)
        assert np.array_equal(e.kv_p[layer], before_p[layer])
    assert _notes(e.d) == [kvt.Notification("prefill", b"req-2 written")]
    assert {b.op for b in e.io.fabric.batches} == {"write"}
    assert e.p.progress() == [t]  # exactly once through progress(), too
    assert e.p.progress() == []


def test_deadline_fails_a_silent_transfer_and_quiesces_later_fake_mori(slow_engines):
    e = slow_engines
    t = e.d.read(e.peer_of_d, e.lay_d.segments([1]), e.lay_p_remote.segments([2]), notify=b"x")
    st = t.wait(5)
    # Ended by the core's deadline (0.3 s), not by wait()'s own 5 s timeout (that returns PENDING).
    assert st.state is kvt.State.FAILED and "deadline" in st.reason
    assert t.finished_at is not None and t.finished_at >= t.deadline
    assert not st.quiesced  # the mori batch is still in flight: memory not reusable yet
    assert e.d.stats()["unquiesced"] == 1
    e.io.fabric.complete_all()  # mori finally completes the batch
    e.d.progress()
    assert t.status().quiesced and e.d.stats()["unquiesced"] == 0
    # No notification for a failed transfer: a sentinel sent afterwards on the same
    # socket is the first thing prefill receives.
    e.d.send_notification(e.peer_of_d, b"sentinel")
    assert _notes(e.p) == [kvt.Notification("decode", b"sentinel")]


def test_peer_failure_fails_before_the_deadline_fake_mori():
    e = Engines(make_fake_mori_io(mode="deferred"), default_timeout_s=30.0)
    try:
        t = e.d.read(e.peer_of_d, e.lay_d.segments([1, 2]), e.lay_p_remote.segments([3, 4]))
        assert t.status().state is kvt.State.PENDING
        key_d = e.d.describe()["engine_key"]
        key_p = e.p.describe()["engine_key"]
        e.io.fabric.inject_peer_failure(key_d, key_p, PeerFailureReason.PEER_UNREACHABLE, "QP 9 fatal")
        e.io.fabric.fail_inflight_to(key_p)
        st = t.wait(2)
        assert st.state is kvt.State.FAILED and "PEER_UNREACHABLE" in st.reason and st.quiesced
        # The connection is condemned until the peer's metadata is connected afresh.
        t2 = e.d.read(e.peer_of_d, e.lay_d.segments([1]), e.lay_p_remote.segments([3]))
        assert t2.wait(2).state is kvt.State.FAILED and "reconnect" in t2.status().reason
        peer = e.d.connect(e.p.metadata())
        t3 = e.d.read(peer, e.lay_d.segments([1]), e.lay_p_remote.segments([3]))
        e.io.fabric.complete_all()
        assert t3.wait(2).ok
    finally:
        e.close()


def test_metadata_round_trip_and_refusals_fake_mori(engines):
    e = engines
    md = e.p.metadata()
    peer = e.d.connect(md)
    assert [r.id for r in peer.regions] == [r.id for r in e.rp]
    assert [r.length for r in peer.regions] == [r.length for r in e.rp]
    with pytest.raises(errors.PeerMetadataError):
        e.d.connect(md[:-7])


def test_fault_injection_wraps_the_backend_fake_mori():
    e = Engines(make_fake_mori_io(), faults=kvt.FaultPlan(fail_rate=1.0, seed=1))
    try:
        t = e.d.read(e.peer_of_d, e.lay_d.segments([0]), e.lay_p_remote.segments([0]))
        assert t.wait(2).state is kvt.State.FAILED
    finally:
        e.close()


def test_unknown_option_through_open_is_typed_fake_mori():
    from kvtransport_moriio.backend import using_mori_module

    with using_mori_module(make_fake_mori_io()):
        with pytest.raises(errors.BackendOptionError, match="qp_per_transfr"):
            kvt.open("moriio", name="z", host="127.0.0.1", qp_per_transfr=2)
