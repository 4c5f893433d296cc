"""The ucx backend between two processes, over tcp, shared memory and cma+tcp: scattered
READ and WRITE arrive byte-exact, notifications arrive (a WRITE's only after its data), the
peer can initiate too, and an idle agent's progress threads sleep.

Notifications are checked against a sentinel sent after them on the same endpoint, never
by waiting a while and looking; the idle CPU share is measured in bench/test_bench_ucx_timing.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvtransport as kvt
from ucx_helpers import (
    SENTINEL,
    TLS_OPTIONS,
    PeerProcess,
    expected_bytes,
    notes_until,
    sha,
    skip_unless_ucx_usable,
)

pytestmark = pytest.mark.timeout(120)

BLOCK = 16 << 10
NBLOCKS = 256
SIZE = BLOCK * NBLOCKS


@pytest.fixture(params=TLS_OPTIONS, ids=lambda o: o["tls"])
def pair(request):
    """(local agent, its buffer, its region, peer handle, peer process)."""
    skip_unless_ucx_usable()
    opts = request.param
    peer = PeerProcess("producer", SIZE, seed=7, options=opts)
    agent = kvt.open("ucx", name="consumer", **opts)
    buf = np.zeros(SIZE, np.uint8)
    region = agent.register(buf)
    try:
        p = agent.connect(peer.metadata)
        assert peer.call(cmd="connect", md=agent.metadata().hex()) == {"ok": True}
        yield agent, buf, region, p, peer
    finally:
        peer.close()
        agent.close()


def _scatter(rng: np.random.Generator, n: int):
    """n distinct source blocks to n distinct destination blocks, shuffled (no contiguity)."""
    src = rng.permutation(NBLOCKS)[:n]
    dst = rng.permutation(NBLOCKS)[:n]
    return src.astype(np.int64) * BLOCK, dst.astype(np.int64) * BLOCK


def test_read_scattered_blocks_byte_exact_and_notifies(pair):
    agent, buf, region, p, peer = pair
    theirs = expected_bytes(SIZE, 7)
    rng = np.random.default_rng(1)
    src, dst = _scatter(rng, 100)
    lens = np.full(100, BLOCK, np.int64)
    t = agent.read(p, region.segments(dst, lens), p.regions[0].segments(src, lens), notify=b"read-done-1",
                   timeout=30)
    st = t.wait()
    assert st.ok, st.reason
    for s, d in zip(src, dst):
        assert np.array_equal(buf[d : d + BLOCK], theirs[s : s + BLOCK])
    untouched = np.setdiff1d(np.arange(NBLOCKS) * BLOCK, dst)
    assert not buf[untouched[0] : untouched[0] + BLOCK].any()  # nothing else written
    agent.send_notification(p, SENTINEL)
    assert peer.notes_until() == [["consumer", b"read-done-1".hex()], ["consumer", SENTINEL.hex()]]


def test_write_scattered_blocks_byte_exact_notify_after_data(pair):
    agent, buf, region, p, peer = pair
    rng = np.random.default_rng(2)
    buf[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    src, dst = _scatter(rng, 128)
    # ragged lengths too: parts of blocks, odd sizes
    lens = rng.integers(1, BLOCK + 1, 128).astype(np.int64)
    before = expected_bytes(SIZE, 7)
    t = agent.write(p, region.segments(src, lens), p.regions[0].segments(dst, lens), notify=b"\x00kv\xff",
                    timeout=30)
    st = t.wait()
    assert st.ok, st.reason
    # The peer hashes right after it sees the notification: the data must already be there.
    agent.send_notification(p, SENTINEL)
    assert peer.notes_until() == [["consumer", b"\x00kv\xff".hex()], ["consumer", SENTINEL.hex()]]
    assert peer.call(cmd="sha", offsets=dst.tolist(), lengths=lens.tolist())["sha"] == sha(buf, src, lens)
    # Bytes outside the written ranges are unchanged.
    untouched = np.setdiff1d(np.arange(NBLOCKS) * BLOCK, dst)[:8]
    assert peer.call(cmd="sha", offsets=untouched.tolist(), lengths=[BLOCK] * len(untouched))["sha"] == \
        sha(before, untouched, [BLOCK] * len(untouched))


def test_peer_initiates_read_and_write_into_this_process(pair):
    agent, buf, region, p, peer = pair
    buf[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)  # pattern 0..255 repeating
    mine = buf.copy()
    # peer READs our blocks 3, 5 into its blocks 0, 1
    ans = peer.call(cmd="read", local=[[0, BLOCK], [BLOCK, BLOCK]], remote=[[3 * BLOCK, BLOCK], [5 * BLOCK, BLOCK]],
                    notify=b"r".hex())
    assert ans["state"] == "DONE", ans
    assert peer.call(cmd="sha", offsets=[0, BLOCK], lengths=[BLOCK, BLOCK])["sha"] == \
        sha(mine, [3 * BLOCK, 5 * BLOCK], [BLOCK, BLOCK])
    # peer WRITEs its blocks 10..11 into our blocks 20..21 (one contiguous run on both sides)
    ans = peer.call(cmd="write", local=[[10 * BLOCK, 2 * BLOCK]], remote=[[20 * BLOCK, 2 * BLOCK]],
                    notify=b"w".hex())
    assert ans["state"] == "DONE", ans
    theirs = expected_bytes(SIZE, 7)
    assert peer.call(cmd="notify", payload=SENTINEL.hex()) == {"ok": True}
    assert notes_until(agent) == [("producer", b"r"), ("producer", b"w"), ("producer", SENTINEL)]
    assert np.array_equal(buf[20 * BLOCK : 22 * BLOCK], theirs[10 * BLOCK : 12 * BLOCK])
    assert np.array_equal(buf[: 20 * BLOCK], mine[: 20 * BLOCK])


def test_many_transfers_in_flight_all_complete(pair):
    agent, buf, region, p, peer = pair
    theirs = expected_bytes(SIZE, 7)
    ts = []
    for i in range(32):
        off = np.array([i * 8 * BLOCK + k * BLOCK for k in range(0, 8, 2)], np.int64)
        lens = np.full(off.size, BLOCK, np.int64)
        ts.append(agent.read(p, region.segments(off, lens), p.regions[0].segments(off, lens), timeout=30))
    for t in ts:
        assert t.wait().ok
    even = (np.arange(NBLOCKS) % 2 == 0).repeat(BLOCK)
    assert np.array_equal(buf[even], theirs[even])
    assert not buf[~even].any()


def test_standalone_notification_both_ways(pair):
    agent, buf, region, p, peer = pair
    agent.send_notification(p, b"ping" * 1000)  # 4 KB
    agent.send_notification(p, SENTINEL)
    assert peer.notes_until() == [["consumer", (b"ping" * 1000).hex()], ["consumer", SENTINEL.hex()]]
    assert peer.call(cmd="notify", payload=b"pong".hex()) == {"ok": True}
    assert peer.call(cmd="notify", payload=SENTINEL.hex()) == {"ok": True}
    assert notes_until(agent) == [("producer", b"pong"), ("producer", SENTINEL)]


def _rounds(*agents: kvt.Agent) -> tuple[int, int]:
    """(progress rounds, rounds that ended in the idle timeout), summed over the agents."""
    ds = [a.describe() for a in agents]
    return sum(d["progress_rounds"] for d in ds), sum(d["idle_wakeups"] for d in ds)


def _until(pred, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s  # bounds a broken run only
    while not pred():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_idle_agents_progress_threads_sleep_until_their_idle_timeout():
    """Idle agents' progress threads block in epoll: every round of an idle thread ends
    because its idle timeout expired, none because it spun. A count, not a CPU share (the
    CPU share is measured in bench/test_bench_ucx_timing.py). Control: ``progress="busy"``
    agents run rounds without any idle wake-up, so the check can fail."""
    skip_unless_ucx_usable()
    with kvt.open("ucx", name="idle-a", tls="tcp") as a, kvt.open("ucx", name="idle-b", tls="tcp") as b:
        a.connect(b.metadata())
        b.connect(a.metadata())
        threads = a.describe()["lanes"] + b.describe()["lanes"]
        # Settle: connecting woke the threads; wait until each could have timed out twice.
        _, i0 = _rounds(a, b)
        _until(lambda: _rounds(a, b)[1] >= i0 + 2 * threads, "idle wake-ups after connect")
        r1, i1 = _rounds(a, b)
        _until(lambda: _rounds(a, b)[1] >= i1 + 4 * threads, "idle wake-ups while idle")
        r2, i2 = _rounds(a, b)
    idle, rounds = i2 - i1, r2 - r1
    # A round that was not an idle timeout needs a wake-up (none is sent while idle) or a
    # spin; allow one stray event per thread (e.g. a tcp keepalive), not a loop.
    assert rounds <= idle + threads, f"{rounds} progress rounds for {idle} idle timeouts"

    with kvt.open("ucx", name="busy-a", tls="tcp", progress="busy") as c, \
            kvt.open("ucx", name="busy-b", tls="tcp", progress="busy") as d:
        c.connect(d.metadata())
        d.connect(c.metadata())
        r1, i1 = _rounds(c, d)
        _until(lambda: _rounds(c, d)[0] >= r1 + 100 * threads, "busy rounds")
        r2, i2 = _rounds(c, d)
    assert i2 == i1 and r2 - r1 > (i2 - i1) + threads  # the control fails the check above
