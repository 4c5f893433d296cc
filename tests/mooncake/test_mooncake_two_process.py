"""The ``mooncake`` backend between two processes, as a user runs it: exact bytes for READ and
WRITE of many scattered blocks (more than Mooncake takes in one batch, so the transfer is
fed in chunks), a peer killed in the middle of a transfer fails it by its deadline and the
memory is reusable once Mooncake's tasks ended, while the agent keeps serving another peer.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.testing.peer import ChildProcessPeer, pattern
from kvtransport.testing.required import skip_unless_usable

BLOCK = 4096
NBLOCKS = 4096  # 16 MiB per side; 4096 segments > one Mooncake TCP queue (1024)
SIZE = BLOCK * NBLOCKS


@pytest.fixture(autouse=True)
def _usable():
    skip_unless_usable("mooncake")


@pytest.mark.parametrize("options", [
    {},  # defaults: 512-segment batches, 1024 in flight per peer
    {"chunk_segments": 64, "max_inflight_segments": 128},  # 64 batches, two in flight at a time
], ids=["default-chunks", "small-chunks"])
def test_read_and_write_scattered_blocks_byte_exact_across_processes(options):
    local = kvt.open("mooncake", name="mc-local", **options)
    far = ChildProcessPeer("mooncake", options, "mc-far", SIZE, seed=2)
    try:
        buf = pattern(1, SIZE)
        region = local.register(buf)
        peer = local.connect(far.metadata())
        remote = peer.region(far.region_id)
        lay_l = kvt.BlockLayout([(region, 0)], BLOCK, NBLOCKS)
        lay_r = kvt.BlockLayout([(remote, 0)], BLOCK, NBLOCKS)
        rng = np.random.default_rng(3)
        lids, rids = rng.permutation(NBLOCKS), rng.permutation(NBLOCKS)

        t = local.read(peer, lay_l.segments(lids[:3000]), lay_r.segments(rids[:3000]))
        assert t.wait(60).ok, t.status()
        want = pattern(2, SIZE).reshape(NBLOCKS, BLOCK)
        got = buf.reshape(NBLOCKS, BLOCK)
        assert np.array_equal(got[lids[:3000]], want[rids[:3000]])
        untouched = np.setdiff1d(np.arange(NBLOCKS), lids[:3000])
        assert np.array_equal(got[untouched], pattern(1, SIZE).reshape(NBLOCKS, BLOCK)[untouched])

        buf[:] = pattern(7, SIZE)
        t = local.write(peer, lay_l.segments(lids), lay_r.segments(rids), notify=b"all-written")
        assert t.wait(60).ok, t.status()
        assert far.notifications(1, 30) == [("mc-local", b"all-written")]
        remote_now = np.frombuffer(far.bytes(), np.uint8).reshape(NBLOCKS, BLOCK)
        assert np.array_equal(remote_now[rids], buf.reshape(NBLOCKS, BLOCK)[lids])
    finally:
        far.close()
        local.close()


def test_killed_peer_mid_transfer_fails_by_deadline_quiesces_and_another_peer_is_served():
    big = 64 << 20
    local = kvt.open("mooncake", name="mc-dead-local")
    victim = ChildProcessPeer("mooncake", {}, "mc-victim", big, seed=4)
    healthy = ChildProcessPeer("mooncake", {}, "mc-healthy", SIZE, seed=5)
    try:
        buf = np.zeros(big, np.uint8)
        region = local.register(buf)
        pv = local.connect(victim.metadata())
        ph = local.connect(healthy.metadata())
        # 16384 segments of 4 KiB, in 32 Mooncake batches: still moving when the peer dies.
        offs = np.arange(big // BLOCK) * BLOCK
        lens = np.full(offs.size, BLOCK)
        rev = offs[::-1].copy()  # reversed on the far side, so nothing merges
        t = local.read(pv, region.segments(offs, lens), pv.region(victim.region_id).segments(rev, lens),
                       timeout=20.0)
        victim.kill()
        st = t.wait(30)
        assert st.state is kvt.State.FAILED, st
        assert "deadline" not in st.reason  # noticed (pid gone / Mooncake failure), not timed out
        # Once every Mooncake task of it ended, nothing more lands: the memory is released
        # for reuse (the core refuses to deregister a region an unquiesced transfer uses).
        limit = time.monotonic() + 60
        while not t.status().quiesced and time.monotonic() < limit:
            time.sleep(0.01)
        assert t.status().quiesced, t.status()
        t.release()

        small = kvt.BlockLayout([(region, 0)], BLOCK, NBLOCKS)
        remote = kvt.BlockLayout([(ph.region(healthy.region_id), 0)], BLOCK, NBLOCKS)
        ids = np.random.default_rng(6).permutation(NBLOCKS)[:1000]
        t2 = local.read(ph, small.segments(ids), remote.segments(ids))
        assert t2.wait(60).ok, t2.status()
        want = pattern(5, SIZE).reshape(NBLOCKS, BLOCK)
        assert np.array_equal(buf[:SIZE].reshape(NBLOCKS, BLOCK)[ids], want[ids])
        local.deregister(region)  # allowed: no transfer holds it any more
    finally:
        victim.close()
        healthy.close()
        local.close()


def test_deadline_fails_an_in_flight_transfer_and_memory_waits_for_quiescence():
    """A READ far larger than its deadline allows: the core fails it at the deadline; Mooncake
    cannot withdraw submitted batches, so the transfer stays unquiesced (its region cannot be
    deregistered) until every task ended -- then the bytes stop changing."""
    big = 64 << 20
    local = kvt.open("mooncake", name="mc-deadline-local")
    far = ChildProcessPeer("mooncake", {}, "mc-deadline-far", big, seed=8)
    try:
        buf = np.zeros(big, np.uint8)
        region = local.register(buf)
        peer = local.connect(far.metadata())
        offs = np.arange(big // BLOCK) * BLOCK
        lens = np.full(offs.size, BLOCK)
        t = local.read(peer, region.segments(offs, lens),
                       peer.region(far.region_id).segments(offs[::-1].copy(), lens), timeout=0.02)
        st = t.wait(30)
        assert st.state is kvt.State.FAILED and "deadline" in st.reason, st
        if not st.quiesced:  # batches were still with Mooncake when the deadline passed
            try:
                local.deregister(region)
            except errors.KVTransportError as exc:  # still moving: the region is held
                assert "quiesced" in str(exc)
            else:  # the last task ended in between: only then may the region go
                assert t.status().quiesced
                region = local.register(buf)
        limit = time.monotonic() + 60
        while not t.status().quiesced and time.monotonic() < limit:
            time.sleep(0.01)
        assert t.status().quiesced
        snapshot = buf.copy()
        # Nothing lands after quiescence: a sentinel transfer on the same connection
        # completes after anything still queued would have.
        one = local.read(peer, region.segments([0], [1]), peer.region(far.region_id).segments([0], [1]))
        assert one.wait(30).ok
        snapshot[0] = buf[0]
        assert np.array_equal(buf, snapshot)
        one.release()
        t.release()
        local.deregister(region)
    finally:
        far.close()
        local.close()


def test_standalone_notification_to_a_killed_peer_is_refused():
    local = kvt.open("mooncake", name="mc-notify-local")
    far = ChildProcessPeer("mooncake", {}, "mc-notify-far", SIZE, seed=9)
    try:
        peer = local.connect(far.metadata())
        local.send_notification(peer, b"before")
        assert far.notifications(1, 30) == [("mc-notify-local", b"before")]
        far.kill()
        with pytest.raises(errors.NotificationError, match="gone"):
            local.send_notification(peer, b"after")
    finally:
        far.close()
        local.close()
