"""A transfer that ends (deadline / cancel) while it is still queued behind another in
the loopback backend must not wedge the backend: later transfers still complete.

Found by the soak (tests/soak): after a few such cancels every READ of the consumer hung
until its deadline (both copy threads blocked forever in ``_part_done``, which re-takes
the job's non-reentrant lock that ``_copy`` already holds)."""

import numpy as np
import pytest

import kvtransport as kvt

pytestmark = pytest.mark.timeout(60)


def test_transfer_cancelled_while_queued_does_not_block_later_ones():
    size = 256 << 20
    # inline_bytes=0: every transfer goes through the copy thread's queue (small ones would
    # otherwise be copied on the posting thread and never queue)
    with kvt.open("loopback", name="q-a", threads=1, inline_bytes=0) as a, kvt.open("loopback", name="q-b") as b:
        ba, bb = np.zeros(size, np.uint8), np.full(size, 7, np.uint8)
        ra, rb = a.register(ba), b.register(bb)
        peer = a.connect(b.metadata())
        whole_a, whole_b = ra.segments([0], [size]), peer.region(rb.id).segments([0], [size])
        busy = [a.read(peer, whole_a, whole_b, timeout=30) for _ in range(3)]  # keep the one copier busy
        # queued behind them; its deadline passes before the copier reaches it -> cancelled
        doomed = a.read(peer, ra.segments([0], [4096]), peer.region(rb.id).segments([0], [4096]), timeout=0.001)
        st = doomed.wait(5)
        assert st.state is kvt.State.FAILED
        for t in busy:
            assert t.wait(30).ok
        later = a.read(peer, ra.segments([0], [4096]), peer.region(rb.id).segments([4096], [4096]), timeout=3)
        assert later.wait(5).ok, "the loopback backend is wedged after a queued transfer was cancelled"
        assert a.stats()["pending"] == 0
