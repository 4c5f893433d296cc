"""A caller that polls a pending transfer in a tight loop must not starve the transfer.

Backends move bytes on their own Python threads (loopback's copy threads here, ucx's
progress threads), which need the GIL between native calls. ``while not t.done: pass`` (or
the same on ``Agent.progress()``) takes the GIL back at once on every turn; without a yield
the threads moving the bytes run only when CPython forces a switch. These tests make that
forced switch practically never happen (``sys.setswitchinterval(10)`` while spinning), so a
transfer finishes within the spin only if polling itself lets the copy threads run. The
bound is a number of polls, not a time: nothing here is timed.

Bytes move through the real loopback backend, two agents in this process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import transfer as transfer_mod

SIZE = 32 << 20  # large enough that post() hands the copy to the copy threads
MAX_POLLS = 200_000  # seconds of spinning; a yielding poll needs a few thousand at most


@pytest.fixture
def pair() -> Iterator[tuple[kvt.Agent, kvt.Agent, np.ndarray, np.ndarray, kvt.Peer]]:
    a = kvt.open("loopback", name="spin-a", threads=2)
    b = kvt.open("loopback", name="spin-b")
    src = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, np.uint8)
    a.register(src)
    b.register(dst)
    b.connect(a.metadata())
    peer = a.connect(b.metadata())
    try:
        yield a, b, src, dst, peer
    finally:
        a.close()
        b.close()


def _spin(until_done: Callable[[], bool]) -> int:
    """Call ``until_done`` until it returns True, at most MAX_POLLS times, with CPython's
    forced GIL switch pushed out of reach; returns the number of calls it took."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        for n in range(1, MAX_POLLS + 1):
            if until_done():
                return n
        return MAX_POLLS + 1
    finally:
        sys.setswitchinterval(old)


def _write(a: kvt.Agent, peer: kvt.Peer) -> kvt.Transfer:
    local = a.regions[0].segments(np.array([0]), np.array([SIZE]))
    remote = peer.regions[0].segments(np.array([0]), np.array([SIZE]))
    return a.write(peer, local, remote)


def test_spinning_on_status_lets_the_transfer_finish(pair) -> None:
    a, _b, src, dst, peer = pair
    t = _write(a, peer)
    polls = _spin(lambda: t.status().done)
    assert polls <= MAX_POLLS, "the transfer never finished while the caller spun on status()"
    assert t.status().ok
    assert np.array_equal(src, dst)


def test_spinning_on_agent_progress_lets_the_transfer_finish(pair) -> None:
    a, _b, src, dst, peer = pair
    t = _write(a, peer)
    polls = _spin(lambda: t in a.progress())
    assert polls <= MAX_POLLS, "the transfer never finished while the caller spun on Agent.progress()"
    assert t.last_status.ok
    assert np.array_equal(src, dst)


def test_a_short_burst_of_polls_does_not_yield_a_spin_does(monkeypatch) -> None:
    """An engine step polls a few times back to back (its hooks after the forward): that
    must not sleep. A loop polling on and on yields on (nearly) every turn once it is
    spinning. The transfer never ends (injected hang), so every answer is pending."""
    yields: list[int] = []
    monkeypatch.setattr(transfer_mod, "yield_gil", lambda: yields.append(1))
    a = kvt.open("loopback", name="spin-hang", faults=kvt.FaultPlan(hang_rate=1.0))
    b = kvt.open("loopback", name="spin-far")
    try:
        src, dst = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        a.register(src)
        b.register(dst)
        b.connect(a.metadata())
        peer = a.connect(b.metadata())
        t = a.write(peer, a.regions[0].segments(np.array([0]), np.array([4096])),
                    peer.regions[0].segments(np.array([0]), np.array([4096])), timeout=60)
        burst = transfer_mod.SPIN_POLLS_BEFORE_YIELD - 1
        for _ in range(burst):
            assert not t.status().done
            assert a.progress() == []
        assert yields == [], "a short burst of polls yielded"
        for _ in range(200):
            t.status()
        # Each turn comes microseconds after the last; a preemption longer than the gap only
        # restarts the count, so on a loaded machine a few turns may not yield.
        assert len(yields) > 100, f"a loop of 200 polls yielded {len(yields)} times"
    finally:
        a.close()
        b.close()
