"""Bounded memory per transfer, and what ``Agent.progress()`` still promises (issue 12.5).

Contract (``kvtransport.transfer.FinishedTransfers``): ``progress()`` returns every
finished transfer at most once, in completion order. One nobody has seen end is kept
until ``progress()`` returns it. One whose terminal state a ``status()``/``wait()``
returned is held only weakly — returned while the caller still holds its ``Transfer``
(or among the latest ``progress_window`` seen ones), forgotten otherwise — so a caller
that only waits leaves nothing behind.

Bytes move through the real loopback backend, two agents in this process.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
import weakref

import numpy as np
import pytest

import kvtransport as kvt

BLOCK = 64


def _pair(prefix: str, **opts):
    a = kvt.open("loopback", name=f"{prefix}-a", threads=1, **opts)
    b = kvt.open("loopback", name=f"{prefix}-b")
    ra = a.register(np.zeros(64 * BLOCK, np.uint8))
    src = np.random.default_rng(0).integers(1, 256, 64 * BLOCK, dtype=np.uint8)
    rb = b.register(src)
    b.connect(a.metadata())
    peer = a.connect(b.metadata())
    return a, b, ra, rb, peer, src


def _traced_total() -> int:
    gc.collect()
    return sum(st.size for st in tracemalloc.take_snapshot().statistics("filename"))


def _top_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> str:
    return "\n".join(str(s) for s in after.compare_to(before, "lineno")[:8])


@pytest.mark.slow
def test_100k_waited_transfers_keep_the_heap_flat():
    """The README's pattern — read, wait, drop the handle — 100,000 times: traced heap
    growth stays under 64 bytes per transfer (it was ~800 when the agent kept every
    finished transfer until a progress() call that never came)."""
    n, warmup = 100_000, 3_000  # warm-up > progress_window: the window is already full
    a, b, ra, rb, peer, src = _pair("heap")
    loc, rem = ra.segments([0], [BLOCK]), peer.region(rb.id).segments([BLOCK], [BLOCK])

    def run(count: int) -> None:
        # Batches of 50 in flight (fewer thread hand-offs than one at a time); every
        # transfer is waited on, then its handle dropped.
        for _ in range(count // 50):
            batch = [a.read(peer, loc, rem) for _ in range(50)]
            for t in batch:
                assert t.wait(10).ok

    tracemalloc.start()
    try:
        run(warmup)
        before_total = _traced_total()
        before = tracemalloc.take_snapshot()
        run(n)
        after_total = _traced_total()
        growth = after_total - before_total
        print(f"\ntraced heap growth over {n} waited transfers: {growth} B "
              f"({growth / n:.2f} B per transfer)")
        assert growth < 64 * n, (
            f"heap grew {growth} bytes over {n} waited transfers "
            f"({growth / n:.1f} B each):\n{_top_growth(before, tracemalloc.take_snapshot())}")
    finally:
        tracemalloc.stop()
    assert np.array_equal(ra.owner[:BLOCK], src[BLOCK:2 * BLOCK])  # the reads moved real bytes
    s = a.stats()
    assert (s["transfers_done"], s["pending"], s["unquiesced"]) == (n + warmup, 0, 0)
    # progress() still reports the ones inside the window: bounded, not everything.
    assert len(a.progress()) == a.config.progress_window
    a.close()
    b.close()


def test_unseen_finished_transfers_are_kept_until_progress_reports_them_once():
    """Fire-and-forget: handles dropped at once, results learnt only from progress().
    Each of them is reported exactly once — and the measurement above would see them,
    because until reported they are held (the control for the heap test)."""
    n = 2_000
    a, b, ra, rb, peer, src = _pair("ff")
    rem = peer.region(rb.id)
    tracemalloc.start()
    try:
        base = _traced_total()
        ids = [a.read(peer, ra.segments([(i % 64) * BLOCK], [BLOCK]),
                      rem.segments([(i % 64) * BLOCK], [BLOCK])).id for i in range(n)]
        held = _traced_total() - base
        assert held > 64 * n  # nobody has seen them end: the agent must keep them
    finally:
        tracemalloc.stop()
    reported: list[int] = []
    refs: list[weakref.ref] = []
    limit = time.monotonic() + a.config.default_timeout_s  # after every deadline (T2)
    while len(reported) < n and time.monotonic() <= limit:
        for t in a.progress():
            reported.append(t.id)
            refs.append(weakref.ref(t))
    del t
    assert sorted(reported) == ids  # each once, none missing
    assert a.progress() == []
    gc.collect()
    assert not any(r() is not None for r in refs)  # once reported, the agent let go
    assert np.array_equal(ra.owner, src)
    a.close()
    b.close()



def test_progress_contract_seen_held_dropped():
    """The three cases side by side, with no window: unseen -> reported; seen and still
    held -> reported; seen and dropped -> forgotten. Each reported once, in completion
    order."""
    a, b, ra, rb, peer, _ = _pair("pc", progress_window=0)
    rem = peer.region(rb.id)

    def read(i: int) -> kvt.Transfer:
        return a.read(peer, ra.segments([i * BLOCK], [BLOCK]), rem.segments([i * BLOCK], [BLOCK]))

    held = read(0)
    assert held.wait(10).ok
    dropped = read(1)
    assert dropped.wait(10).ok
    dropped_id = dropped.id
    del dropped
    gc.collect()
    unseen = read(2)
    unseen_id = unseen.id
    del unseen  # fire-and-forget
    got: list[kvt.Transfer] = []
    limit = time.monotonic() + a.config.default_timeout_s  # after every deadline (T2)
    while unseen_id not in [t.id for t in got] and time.monotonic() < limit:
        got += a.progress()
    ids = [t.id for t in got]
    assert ids == [held.id, unseen_id] and dropped_id not in ids
    assert got[0] is held
    assert a.progress() == []
    # Seeing a transfer's end *after* progress() reported it reports nothing new.
    assert got[1].status().ok and a.progress() == []
    a.close()
    b.close()


def test_window_keeps_recently_seen_transfers_for_a_late_progress_call():
    """Default window: wait on two transfers, drop both handles, then drain progress():
    both are reported (the pattern of a caller mixing wait() and progress())."""
    a, b, ra, rb, peer, _ = _pair("win")
    rem = peer.region(rb.id)
    ids = []
    for i in range(2):
        t = a.read(peer, ra.segments([i * BLOCK], [BLOCK]), rem.segments([i * BLOCK], [BLOCK]))
        assert t.wait(10).ok
        ids.append(t.id)
    del t
    gc.collect()
    assert [x.id for x in a.progress()] == ids
    assert a.progress() == []
    a.close()
    b.close()

