"""The agent: registration, connect rules, the transfer contracts T1-T4, fault injection.

Bytes move through the real loopback backend (two agents in this process), except in
the T3 tests, which need a backend that cannot promise quiescence: there a small
*test double* of the SPI stands in, and is named so.
"""

from __future__ import annotations

import ctypes
import select
import threading
import time
from typing import Any

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.agent import Agent, AgentConfig
from kvtransport.spi import Backend, Op, PollResult
from kvtransport.testing.fault_controls import kill_peer

SIZE = 1 << 16


@pytest.fixture
def two():
    """Two loopback agents in this process; ``b`` connected to ``a`` and back."""
    a = kvt.open("loopback", name="a")
    b = kvt.open("loopback", name="b")
    yield a, b
    a.close()
    b.close()


def _connect(x: Agent, y: Agent):
    """Connect both ways; return x's Peer for y."""
    y.connect(x.metadata())
    return x.connect(y.metadata())


def _src(seed: int = 0, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _wait_for(pred, timeout: float = 10.0) -> bool:
    limit = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > limit:
            return False
        time.sleep(0.002)
    return True


# -- register ---------------------------------------------------------------------------

def _read_all_into(dst_agent: Agent, dst_region, src_agent: Agent, src_region) -> None:
    peer = _connect(dst_agent, src_agent)
    n = min(dst_region.length, src_region.length)
    t = dst_agent.read(peer, dst_region.segments([0], [n]), peer.region(src_region.id).segments([0], [n]))
    assert t.wait(10).ok, t.status()


def test_register_numpy_multidimensional(two):
    a, b = two
    arr = np.zeros((8, 64), dtype=np.float32)
    r = b.register(arr)
    assert (r.addr, r.length, r.kind) == (arr.ctypes.data, arr.nbytes, "cpu")
    src = _src(1, arr.nbytes)
    _read_all_into(b, r, a, a.register(src))
    assert arr.tobytes() == src.tobytes()


def test_register_bytearray(two):
    a, b = two
    ba = bytearray(4096)
    r = b.register(ba)
    assert r.length == 4096
    src = _src(2, 4096)
    _read_all_into(b, r, a, a.register(src))
    assert bytes(ba) == src.tobytes()


def test_register_torch_cpu_tensor(two):
    torch = pytest.importorskip("torch")
    a, b = two
    t = torch.zeros((4, 512), dtype=torch.float16)
    r = b.register(t)
    assert (r.addr, r.length, r.kind) == (t.data_ptr(), 4 * 512 * 2, "cpu")
    src = _src(3, r.length)
    _read_all_into(b, r, a, a.register(src))
    assert t.numpy().tobytes() == src.tobytes()
    # A contiguous view with a storage offset registers its own bytes.
    view = t[2:]
    rv = b.register(view)
    assert rv.addr == t.data_ptr() + 2 * 512 * 2 and rv.length == 2 * 512 * 2


def test_register_raw_address_and_length(two):
    a, b = two
    raw = (ctypes.c_char * 4096)()
    r = b.register((ctypes.addressof(raw), 4096))
    assert (r.addr, r.length) == (ctypes.addressof(raw), 4096)
    src = _src(4, 4096)
    _read_all_into(b, r, a, a.register(src))
    assert raw.raw == src.tobytes()


def test_register_refuses_unsafe_buffers(two):
    a, _ = two
    ro = np.zeros(64, np.uint8)
    ro.flags.writeable = False
    cases = [
        (np.zeros(128, np.uint8)[::2], "not contiguous"),
        (np.zeros((8, 8), np.uint8).T[::2], "not contiguous"),
        (ro, "read-only"),
        (b"immutable bytes", "read-only"),
        (np.zeros(0, np.uint8), "empty"),
        ((0, 4096), "positive address"),
        ((4096, 0), "positive address"),
        ([1, 2, 3], "cannot register list"),
    ]
    try:
        import torch
    except ImportError:  # torch is optional; the numpy cases still run
        pass
    else:
        cases.append((torch.zeros(8, 8).t(), "not contiguous"))
    for buf, what in cases:
        with pytest.raises(errors.InvalidSegmentsError, match=what):
            a.register(buf)
    with pytest.raises(errors.InvalidSegmentsError, match="cannot register 'cuda' memory"):
        a.register(np.zeros(64, np.uint8), kind="cuda")
    assert a.regions == []


# -- deregister -------------------------------------------------------------------------

def test_deregister_refused_while_a_transfer_is_pending():
    a = kvt.open("loopback", name="dr-a", faults=kvt.FaultPlan(hang_rate=1.0))
    b = kvt.open("loopback", name="dr-b")
    try:
        ra, rb = a.register(np.zeros(SIZE, np.uint8)), b.register(_src())
        peer = _connect(a, b)
        t = a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]), timeout=0.3)
        with pytest.raises(errors.KVTransportError, match=f"region {ra.id} is in use by transfers \\[{t.id}\\]"):
            a.deregister(ra)
        assert ra in a.regions
        st = t.wait(10)
        assert st.state is kvt.State.FAILED and st.quiesced
        a.deregister(ra)  # allowed once the transfer ended and nothing can land
        assert a.regions == []
        with pytest.raises(errors.UnregisteredMemoryError):
            a.deregister(ra)
        with pytest.raises(errors.UnregisteredMemoryError, match="no registered memory"):
            a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]))
    finally:
        a.close()
        b.close()


# -- connect rules ----------------------------------------------------------------------

def test_self_connect_refused(two):
    a, _ = two
    a.register(np.zeros(64, np.uint8))
    with pytest.raises(errors.IncompatiblePeerError, match="itself"):
        a.connect(a.metadata())
    assert a.peers == {}


def test_unknown_backend_option_refused():
    with pytest.raises(errors.BackendOptionError, match="bogus"):
        kvt.open("loopback", name="opt", bogus=1)
    with pytest.raises(errors.BackendOptionError, match="threads"):
        kvt.open("loopback", name="opt", threads=0)


def test_stale_peer_after_disconnect_and_pending_transfer_failed():
    a = kvt.open("loopback", name="dc-a", faults=kvt.FaultPlan(hang_rate=1.0))
    b = kvt.open("loopback", name="dc-b")
    try:
        ra, rb = a.register(np.zeros(SIZE, np.uint8)), b.register(_src())
        peer = _connect(a, b)
        t = a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]))
        a.disconnect(peer)
        st = t.status()
        assert st.state is kvt.State.FAILED and "disconnected" in st.reason
        with pytest.raises(errors.UnknownPeerError):
            a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]))
        with pytest.raises(errors.UnknownPeerError):
            a.disconnect(peer)
        assert [x.id for x in a.progress()] == [t.id]
    finally:
        a.close()
        b.close()


# -- T4: validation ---------------------------------------------------------------------

@pytest.mark.parametrize("timeout", [0, -1.0])
def test_non_positive_timeout_refused(two, timeout):
    a, b = two
    ra, rb = a.register(np.zeros(64, np.uint8)), b.register(np.zeros(64, np.uint8))
    peer = _connect(a, b)
    with pytest.raises(errors.InvalidSegmentsError, match="timeout"):
        a.read(peer, ra.whole(), peer.region(rb.id).whole(), timeout=timeout)


def test_nan_timeout_refused(two):
    """CORE BUG: ``timeout=float('nan')`` passes the ``timeout_s <= 0`` check, so the
    deadline is NaN, ``now >= deadline`` is never true and a silent transfer is never
    failed (T2 broken). Fix in ``Agent._post`` (and ``prepare``, and for
    ``AgentConfig.default_timeout_s``): refuse ``not math.isfinite(t) or t <= 0`` —
    or at least ``not t > 0`` — with InvalidSegmentsError."""
    a, b = two
    ra, rb = a.register(np.zeros(64, np.uint8)), b.register(np.zeros(64, np.uint8))
    peer = _connect(a, b)
    with pytest.raises(errors.InvalidSegmentsError, match="timeout"):
        a.read(peer, ra.whole(), peer.region(rb.id).whole(), timeout=float("nan"))


def test_out_of_range_error_names_the_callers_segment_index(two):
    """CORE BUG (minor, diagnostics): the range check runs on *merged* segments, so the
    error names the merged index. Here the caller's third segment (index 2) is out of
    range, but the message says "segment 1" because segments 0 and 1 merged. Fix: run
    ``_RegionIndex.resolve`` on the caller's arrays before ``merge_pairs`` (and take the
    merged addresses as ``addr[starts]``), or map the merged index back through the run
    starts."""
    a, b = two
    ra, rb = a.register(np.zeros(4096, np.uint8)), b.register(np.zeros(4096, np.uint8))
    peer = _connect(a, b)
    local = ra.segments([0, 8, 4000], [8, 8, 200])
    remote = peer.region(rb.id).segments([0, 8, 16], [8, 8, 200])
    with pytest.raises(errors.InvalidSegmentsError, match=r"local segment 2 \[offset 4000, \+200\)"):
        a.read(peer, local, remote)


def test_send_notification_payload_must_be_bytes(two):
    """CORE BUG (minor): ``Agent.send_notification`` does ``bytes(payload)``, so an int 5
    silently sends five zero bytes and a str raises a bare TypeError. Fix: check
    ``isinstance(payload, (bytes, bytearray, memoryview))`` as ``_post`` does for
    ``notify`` and raise InvalidSegmentsError naming the type."""
    a, b = two
    peer = _connect(a, b)
    for bad in (5, "hello"):
        with pytest.raises(errors.KVTransportError, match="bytes"):
            a.send_notification(peer, bad)
    # A sentinel sent after the refused ones: one sender's messages arrive in order, so
    # anything the refused calls had sent would arrive before it.
    a.send_notification(peer, b"sentinel")
    got: list = []
    assert _wait_for(lambda: bool(got.extend(b.notifications()) or got))
    assert [(n.peer, n.payload) for n in got] == [("a", b"sentinel")]


# -- T1: exactly once -------------------------------------------------------------------

def test_progress_reports_each_terminal_transfer_once_with_concurrent_status_polling():
    """300 transfers, about a third failing by injection and half of the rest reported
    late (so completions land while everyone polls); two threads hammer ``status()``
    while the main thread drains ``progress()``: every transfer comes out exactly once
    and its terminal state never changes afterwards."""
    n = 300
    a = kvt.open("loopback", name="x1-a",
                 faults=kvt.FaultPlan(fail_rate=0.3, delay_s=0.05, delay_rate=0.5, seed=7))
    b = kvt.open("loopback", name="x1-b")
    try:
        dst = np.zeros(n * 64, np.uint8)
        src = _src(5, n * 64)
        ra, rb = a.register(dst), b.register(src)
        peer = _connect(a, b)
        rem = peer.region(rb.id)
        ts = [a.read(peer, ra.segments([i * 64], [64]), rem.segments([i * 64], [64])) for i in range(n)]
        stop = threading.Event()
        seen_states: list[dict[int, kvt.State]] = [{}, {}]

        def poller(k: int) -> None:
            while not stop.is_set():
                for t in ts:
                    st = t.status()
                    if st.done:
                        prev = seen_states[k].setdefault(t.id, st.state)
                        assert prev is st.state
        threads = [threading.Thread(target=poller, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        reported: list[int] = []
        # T2: every transfer is terminal by its own deadline, so polling past the latest
        # one (then once more below) must have reported all of them.
        limit = max(t.deadline for t in ts)
        while len(reported) < n and time.monotonic() <= limit:
            reported += [t.id for t in a.progress()]
        stop.set()
        for th in threads:
            th.join()
        reported += [t.id for t in a.progress()]
        assert sorted(reported) == [t.id for t in ts]  # each once, none missing
        assert a.progress() == []
        states = {t.id: t.status().state for t in ts}
        for k in range(2):
            assert all(states[i] is s for i, s in seen_states[k].items())
        failed = [t for t in ts if states[t.id] is kvt.State.FAILED]
        done = [t for t in ts if states[t.id] is kvt.State.DONE]
        assert failed and done
        assert len(failed) == a.stats()["faults_injected"]["fail"]
        s = a.stats()
        assert (s["transfers_done"], s["transfers_failed"], s["pending"]) == (len(done), len(failed), 0)
        got, want = dst.reshape(n, 64), src.reshape(n, 64)
        assert all(np.array_equal(got[t.id - ts[0].id], want[t.id - ts[0].id]) for t in done)
        assert not any(got[t.id - ts[0].id].any() for t in failed)  # injected failures moved nothing
    finally:
        a.close()
        b.close()


# -- T2: deadlines ----------------------------------------------------------------------

def test_silent_transfer_failed_by_its_deadline_through_progress_alone():
    a = kvt.open("loopback", name="t2-a", faults=kvt.FaultPlan(hang_rate=1.0))
    b = kvt.open("loopback", name="t2-b")
    try:
        ra, rb = a.register(np.zeros(SIZE, np.uint8)), b.register(_src())
        peer = _connect(a, b)
        t = a.read(peer, ra.segments([0], [4096]), peer.region(rb.id).segments([0], [4096]), timeout=0.25)
        # Every progress() call, with the monotonic times it started and returned.
        calls: list[tuple[float, float, list[int]]] = []

        def poll() -> bool:
            start = time.monotonic()
            got = [x.id for x in a.progress()]
            calls.append((start, time.monotonic(), got))
            return bool(got)
        assert _wait_for(poll, timeout=10)
        # Reported once, by the last call; every call before it reported nothing.
        assert calls[-1][2] == [t.id] and all(got == [] for _, _, got in calls[:-1])
        # Never before the deadline: failed at or after it, by a call that ended after it.
        assert t.deadline <= t.finished_at <= calls[-1][1]
        # Promptly after it: no call that started at or after the deadline missed it
        # (so only the call straddling the deadline, or the next one, can have failed it).
        assert all(got == [t.id] for start, _, got in calls if start >= t.deadline)
        st = t.status()
        assert st.state is kvt.State.FAILED and "deadline" in st.reason and st.quiesced
        assert a.stats()["transfers_timed_out"] == 1
        assert a.stats()["faults_injected"]["hang"] == 1
        assert not ra.owner.any()
    finally:
        a.close()
        b.close()


def test_delayed_completion_reported_done_after_the_delay():
    delay = 0.8  # long enough that the test observes the transfer within it
    a = kvt.open("loopback", name="dl-a", faults=kvt.FaultPlan(delay_s=delay))
    b = kvt.open("loopback", name="dl-b")
    try:
        dst, src = np.zeros(SIZE, np.uint8), _src(6)
        ra, rb = a.register(dst), b.register(src)
        peer = _connect(a, b)
        t = a.read(peer, ra.whole(), peer.region(rb.id).whole(), timeout=10)
        # The injector reports completion no earlier than delay after its post, which
        # came after the transfer's posted_at: every status seen before then is PENDING.
        ready = t.posted_at + delay
        seen: list[tuple[float, kvt.State]] = []

        def observe() -> bool:
            st = t.status()
            seen.append((time.monotonic(), st.state))
            return st.done
        assert _wait_for(observe, timeout=10)
        assert seen[-1][1] is kvt.State.DONE
        early = [state for at, state in seen if at < ready]
        assert early and set(early) == {kvt.State.PENDING}
        assert t.finished_at >= ready
        assert np.array_equal(dst, src)
        assert a.stats()["faults_injected"] == {"delay": 1}
    finally:
        a.close()
        b.close()


def test_wait_any_returns_whichever_ends_first_and_keeps_deadlines():
    """``kvt.wait_any``: the transfer that ends first is returned while the other is still
    pending; a silent one is failed by its own deadline while waited on (nobody else
    polls); a wait that times out returns nothing; transfers of two agents are refused."""
    a = kvt.open("loopback", name="wa-a", faults=kvt.FaultPlan(hang_rate=1.0))
    b = kvt.open("loopback", name="wa-b")
    c = kvt.open("loopback", name="wa-c", faults=kvt.FaultPlan(delay_s=0.3))
    try:
        ra, rb, rc = a.register(np.zeros(SIZE, np.uint8)), b.register(_src(3)), c.register(np.zeros(SIZE, np.uint8))
        peer_ab, peer_cb = _connect(a, b), _connect(c, b)
        slow = a.read(peer_ab, ra.segments([0], [4096]), peer_ab.region(rb.id).segments([0], [4096]), timeout=30)
        soon = a.read(peer_ab, ra.segments([4096], [4096]), peer_ab.region(rb.id).segments([4096], [4096]),
                      timeout=0.3)
        ended = kvt.wait_any([slow, soon], timeout=20)
        assert ended == [soon] and soon.finished_at >= soon.deadline
        assert soon.last_status.state is kvt.State.FAILED and "deadline" in soon.last_status.reason
        assert slow.last_status.state is kvt.State.PENDING
        delayed = c.read(peer_cb, rc.whole(), peer_cb.region(rb.id).whole(), timeout=10)
        assert kvt.wait_any([delayed], timeout=0.01) == []  # reported 0.3 s after its post
        assert kvt.wait_any([delayed], timeout=20) == [delayed]
        assert delayed.last_status.state is kvt.State.DONE and np.array_equal(rc.owner, rb.owner)
        with pytest.raises(ValueError, match="different agents"):
            kvt.wait_any([slow, delayed], timeout=0.01)
    finally:
        a.close()
        b.close()
        c.close()


def test_progress_fd_wakes_a_poll_when_a_transfer_ends_and_stops_when_closed():
    """``Agent.open_progress_fd``: cleared, the fd is not readable; a read's end makes it
    readable (a select that would otherwise wait 20 s returns), and the bytes have landed by
    then; a closed fd is no longer signalled (the agent's next transfers still complete)."""
    # inline_bytes=0: every copy on the backend's copy thread, which signals its end
    a, b = kvt.open("loopback", name="pf-a", inline_bytes=0), kvt.open("loopback", name="pf-b")
    try:
        big = 128 << 20  # a copy of tens of ms: still running when first looked at
        ra, rb = a.register(np.zeros(big, np.uint8)), b.register(_src(5, big))
        peer = _connect(a, b)
        fd = a.open_progress_fd()
        fd.clear()
        assert select.select([fd], [], [], 0)[0] == []
        t = a.read(peer, ra.whole(), peer.region(rb.id).whole(), timeout=30)
        waits = 0
        for _ in range(100):  # a signal says "may have changed": clear, look, then wait
            fd.clear()
            if t.status().state is not kvt.State.PENDING:
                break
            assert select.select([fd], [], [], 20)[0] == [fd], "no progress signal within 20 s"
            waits += 1
        assert waits >= 1  # the end was seen through the fd, not by the first look
        assert t.last_status.state is kvt.State.DONE and np.array_equal(ra.owner, rb.owner)
        fd.close()
        fd.close()  # idempotent
        ra.owner[:] = 0
        assert a.read(peer, ra.whole(), peer.region(rb.id).whole(), timeout=30).wait(20).state is kvt.State.DONE
        assert np.array_equal(ra.owner, rb.owner)
    finally:
        a.close()
        b.close()


# -- fault injection: notifications and dead peers ------------------------------------------

def test_dropped_and_duplicated_notifications_are_counted():
    a = kvt.open("loopback", name="nf-a")
    drop = kvt.open("loopback", name="nf-drop", faults=kvt.FaultPlan(drop_notify_rate=1.0))
    dup = kvt.open("loopback", name="nf-dup", faults=kvt.FaultPlan(dup_notify_rate=1.0))
    try:
        to_drop, to_dup = _connect(a, drop), _connect(a, dup)
        for i in range(3):
            a.send_notification(to_drop, b"d%d" % i)
        for i in range(2):
            a.send_notification(to_dup, b"x%d" % i)
        got_drop: list = []
        assert _wait_for(lambda: bool(got_drop.extend(drop.notifications()) or
                                      drop.stats()["faults_injected"].get("drop_notify") == 3))
        assert got_drop == []
        got_dup: list = []
        assert _wait_for(lambda: bool(got_dup.extend(dup.notifications()) or len(got_dup) >= 4))
        assert [(n.peer, n.payload) for n in got_dup] == [("nf-a", b"x0")] * 2 + [("nf-a", b"x1")] * 2
        assert dup.stats()["faults_injected"] == {"dup_notify": 2}
        assert drop.stats()["faults_injected"] == {"drop_notify": 3}
    finally:
        for x in (a, drop, dup):
            x.close()


def test_kill_peer_fails_pending_and_later_transfers_other_peers_unaffected():
    # READs are held back 5 s (a transfer "in flight"); WRITEs are not perturbed.
    a = kvt.open("loopback", name="kp-a", faults=kvt.FaultPlan(delay_s=5.0, ops=frozenset({Op.READ})))
    victim, healthy = kvt.open("loopback", name="kp-victim"), kvt.open("loopback", name="kp-ok")
    try:
        dst = np.zeros(SIZE, np.uint8)
        ra = a.register(dst)
        rv, rh = victim.register(_src(8)), healthy.register(np.zeros(SIZE, np.uint8))
        pv, ph = _connect(a, victim), _connect(a, healthy)
        seg = ra.segments([0], [4096])
        pending = a.read(pv, seg, pv.region(rv.id).segments([0], [4096]), timeout=30)
        assert pending.status().state is kvt.State.PENDING
        kill_peer(a.faults, "kp-victim")
        # The very next poll fails it: neither the injected 5 s delay nor the 30 s deadline
        # is what ends it.
        st = pending.status()
        assert st.state is kvt.State.FAILED and "dead" in st.reason
        assert pending.finished_at < pending.deadline
        later = a.write(pv, seg, pv.region(rv.id).segments([0], [4096]))
        assert later.wait(10).state is kvt.State.FAILED
        ok = a.write(ph, seg, ph.region(rh.id).segments([0], [4096]))
        assert ok.wait(10).ok
        assert rh.owner[:4096].tobytes() == dst[:4096].tobytes()
        inj = a.stats()["faults_injected"]
        assert inj["peer_killed"] == 1 and inj["fail_dead_peer"] == 1
    finally:
        for x in (a, victim, healthy):
            x.close()


def test_kill_peer_also_fails_a_hung_pending_transfer():
    """FAULT INJECTOR BUG (minor): ``kill_peer`` promises "every transfer to peer_name
    fails, pending ones included", but ``FaultInjectingBackend.poll`` returns PENDING for
    a "hang" handle before it checks ``_killed``, so a hung transfer to a killed peer
    waits for its deadline. Fix: in ``poll`` test ``handle.peer_name in self._killed``
    first (for handles with ``inner is None`` return ``failed(..., quiesced=True)``)."""
    a = kvt.open("loopback", name="kh-a", faults=kvt.FaultPlan(hang_rate=1.0))
    b = kvt.open("loopback", name="kh-b")
    try:
        ra, rb = a.register(np.zeros(SIZE, np.uint8)), b.register(_src())
        peer = _connect(a, b)
        t = a.read(peer, ra.segments([0], [64]), peer.region(rb.id).segments([0], [64]), timeout=30)
        kill_peer(a.faults, "kh-b")
        st = t.status()  # the first poll after the kill, not the 30 s deadline, fails it
        assert st.state is kvt.State.FAILED and "dead" in st.reason
    finally:
        a.close()
        b.close()


# -- T3: quiesced before reuse (with an SPI test double) ---------------------------------------

class _Handle:
    def __init__(self, req):
        self.req = req
        self.fail_unquiesced = False


class QuiescenceTestDouble(Backend):
    """TEST DOUBLE of the backend SPI, not a transport: moves no bytes. Transfers stay
    PENDING; ``cancel`` cannot promise quiescence; ``quiesced()`` turns True only when
    the test sets ``can_quiesce``. It exercises the core's T3 bookkeeping alone."""

    name = "quiescence-test-double"

    def __init__(self, agent_name: str):
        super().__init__(agent_name, {})
        self.can_quiesce = False
        self.cancelled: list[int] = []
        self.released: list[int] = []
        self.deregistered: list[int] = []
        self.refuse_posts = False

    def register(self, region) -> bytes:
        return b""

    def deregister(self, region) -> None:
        self.deregistered.append(region.id)

    def export(self) -> bytes:
        return b""

    def connect(self, peer_name: str, blob: bytes, regions) -> Any:
        return peer_name

    def post(self, req):
        if self.refuse_posts:
            raise RuntimeError("queue full")
        return _Handle(req)

    def poll(self, handle: _Handle) -> PollResult:
        if handle.fail_unquiesced:
            return PollResult.failed("link reset", quiesced=False)
        return PollResult.pending()

    def cancel(self, handle: _Handle) -> bool:
        self.cancelled.append(handle.req.transfer_id)
        return False

    def quiesced(self, handle: _Handle) -> bool:
        return self.can_quiesce

    def release(self, handle: _Handle) -> None:
        self.released.append(handle.req.transfer_id)

    def notifications(self):
        return []

    def close(self) -> None:
        pass


def _connected_doubles(double_cls: type[Backend], names: tuple[str, str]):
    """Two agents over test doubles, ``a`` connected to ``b``: yields (agent a, a's
    double, a's region, peer b, b's region as seen from a); closes both after."""
    da, db = double_cls(names[0]), double_cls(names[1])
    a, b = Agent(da, AgentConfig(name=names[0])), Agent(db, AgentConfig(name=names[1]))
    ra = a.register(np.zeros(4096, np.uint8))
    rb = b.register(np.zeros(4096, np.uint8))
    peer = a.connect(b.metadata())
    yield a, da, ra, peer, peer.region(rb.id)
    a.close()
    b.close()


@pytest.fixture
def doubles():
    yield from _connected_doubles(QuiescenceTestDouble, ("qa", "qb"))


def test_T3_failed_by_deadline_keeps_region_until_backend_confirms_quiescence(doubles):
    a, double, ra, peer, rem = doubles
    t = a.write(peer, ra.segments([0], [64]), rem.segments([0], [64]), timeout=0.1)
    st = t.wait(10)
    assert st.state is kvt.State.FAILED and "deadline" in st.reason
    assert st.quiesced is False
    assert double.cancelled == [t.id]
    assert [x.id for x in a.progress()] == [t.id]  # reported once, when it failed
    assert a.stats()["unquiesced"] == 1
    with pytest.raises(errors.KVTransportError, match="not yet quiesced"):
        a.deregister(ra)
    t.release()
    assert double.released == []  # the backend may still be writing: keep its resources
    for _ in range(3):  # polling does not flip it on its own
        assert t.status().quiesced is False
        assert a.progress() == []
    double.can_quiesce = True
    st = t.status()
    assert st.state is kvt.State.FAILED and st.quiesced is True and "deadline" in st.reason
    assert a.progress() == []  # quiescence is not a second completion
    assert a.stats()["unquiesced"] == 0
    a.deregister(ra)
    assert double.deregistered == [ra.id]
    t.release()
    assert double.released == [t.id]


def test_T3_deregister_rechecks_quiescence_for_a_caller_who_never_calls_progress(doubles):
    """A caller who only waits never calls progress(), which used to be the only place
    the agent re-asked the backend about quiescence; deregister asks itself, so the
    region is freed once the backend can promise nothing lands."""
    a, double, ra, peer, rem = doubles
    t = a.write(peer, ra.segments([0], [64]), rem.segments([0], [64]), timeout=0.1)
    st = t.wait(10)
    assert st.state is kvt.State.FAILED and not st.quiesced
    del t
    with pytest.raises(errors.KVTransportError, match="not yet quiesced"):
        a.deregister(ra)
    double.can_quiesce = True
    a.deregister(ra)
    assert double.deregistered == [ra.id] and a.stats()["unquiesced"] == 0


def test_T3_backend_reported_failure_without_quiescence(doubles):
    a, double, ra, peer, rem = doubles
    t = a.read(peer, ra.segments([0], [64]), rem.segments([0], [64]), timeout=30)
    assert t.status().state is kvt.State.PENDING
    t.backend_handle.fail_unquiesced = True
    st = t.status()
    assert (st.state, st.reason, st.quiesced) == (kvt.State.FAILED, "link reset", False)
    assert double.cancelled == []  # the backend said so itself: no cancel needed
    with pytest.raises(errors.KVTransportError, match="in use"):
        a.deregister(ra)
    double.can_quiesce = True
    assert [x.id for x in a.progress()] == [t.id]
    assert t.status().quiesced
    a.deregister(ra)


def test_backend_refusing_a_post_fails_the_transfer_once(doubles):
    a, double, ra, peer, rem = doubles
    double.refuse_posts = True
    t = a.write(peer, ra.segments([0], [64]), rem.segments([0], [64]))
    st = t.status()
    assert st.state is kvt.State.FAILED and "queue full" in st.reason and st.quiesced
    assert [x.id for x in a.progress()] == [t.id]
    assert a.progress() == [] and a.pending() == 0
    a.deregister(ra)


def test_close_fails_pending_transfers_once(doubles):
    a, double, ra, peer, rem = doubles
    t = a.write(peer, ra.segments([0], [64]), rem.segments([0], [64]))
    a.close()
    st = t.status()
    assert st.state is kvt.State.FAILED and "closed" in st.reason
    assert [x.id for x in a.progress()] == [t.id]
    assert a.progress() == []
    with pytest.raises(errors.AgentClosedError):
        a.notifications()


# -- wait() and backends that promise a signal (PollResult.will_signal) --------------------

class SignalPromiseTestDouble(QuiescenceTestDouble):
    """TEST DOUBLE of the backend SPI, not a transport: moves no bytes. A transfer stays
    PENDING with ``will_signal`` until the test finishes it; ``finish(signal=...)`` says
    whether the double keeps its promise to signal. Counts polls."""

    name = "signal-promise-test-double"

    def __init__(self, agent_name: str):
        super().__init__(agent_name)
        self.finished = threading.Event()
        self.polls = 0

    def poll(self, handle: _Handle) -> PollResult:
        self.polls += 1
        if self.finished.is_set():
            return PollResult.done()
        return PollResult.pending(will_signal=True)

    def finish(self, signal: bool) -> None:
        self.finished.set()
        if signal:
            self.signal_progress()


@pytest.fixture
def promising():
    yield from _connected_doubles(SignalPromiseTestDouble, ("sa", "sb"))


def test_wait_sleeps_until_the_promised_signal_instead_of_polling(promising):
    """With the promise, wait() polls when signalled (and once per safety cap), not on its
    back-off: over 30 ms the back-off alone would poll ~20 times."""
    a, double, ra, peer, rem = promising
    t = a.write(peer, ra.segments([0], [64]), rem.segments([0], [64]), timeout=30)
    assert t.backend_handle is not None and t.awaits_signal
    before = double.polls
    timer = threading.Timer(0.03, double.finish, kwargs={"signal": True})
    timer.start()
    st = t.wait(10)
    timer.join()
    assert st.state is kvt.State.DONE
    assert double.polls - before <= 4, double.polls - before


def test_wait_still_ends_when_a_backend_breaks_its_signal_promise(promising):
    """A backend that promised a signal and never gives it costs the waiter at most the
    safety cap, not the transfer's deadline: the transfer is seen DONE."""
    from kvtransport.transfer import SIGNALLED_WAIT_CAP_S
    a, double, ra, peer, rem = promising
    t = a.write(peer, ra.segments([0], [64]), rem.segments([0], [64]), timeout=60)
    timer = threading.Timer(0.01, double.finish, kwargs={"signal": False})
    timer.start()
    st = t.wait(20 * SIGNALLED_WAIT_CAP_S + 5)  # far below the 60 s deadline
    timer.join()
    assert st.state is kvt.State.DONE, st
    assert a.stats()["pending"] == 0


def test_wait_enforces_the_deadline_while_a_signal_is_promised(promising):
    a, double, ra, peer, rem = promising
    t = a.write(peer, ra.segments([0], [64]), rem.segments([0], [64]), timeout=0.2)
    st = t.wait(30)
    assert st.state is kvt.State.FAILED and "deadline" in st.reason


def test_close_wakes_a_waiter_sleeping_on_a_promised_signal(promising):
    """close() fails the transfer itself (the backend never signals): the waiter is woken
    by the core, it does not sleep out the safety cap."""
    a, double, ra, peer, rem = promising
    t = a.write(peer, ra.segments([0], [64]), rem.segments([0], [64]), timeout=60)
    out = {}
    waiter = threading.Thread(target=lambda: out.setdefault("st", t.wait(30)))
    waiter.start()
    gen = a._progress_gen
    a.close()
    assert a._progress_gen > gen  # waiters were signalled
    waiter.join(30)
    assert out["st"].state is kvt.State.FAILED and "closed" in out["st"].reason
