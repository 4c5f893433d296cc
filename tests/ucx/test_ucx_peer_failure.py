"""Killing a peer process mid-transfer fails its transfers well before their deadline (the
backend detects it: tcp endpoint error, or the pid liveness check for shared memory), and
the surviving agent keeps serving another peer in both directions."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kvtransport as kvt
from ucx_helpers import TLS_OPTIONS, PeerProcess, expected_bytes, skip_unless_ucx_usable

pytestmark = pytest.mark.timeout(180)

SIZE = 64 << 20
TIMEOUT = 20.0


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("opts", TLS_OPTIONS, ids=lambda o: o["tls"])
def test_killed_peer_fails_transfers_before_deadline_and_agent_survives(opts, op):
    skip_unless_ucx_usable()
    victim = PeerProcess("victim", SIZE, seed=11, options=opts)
    other = None
    agent = kvt.open("ucx", name="survivor", **opts)
    try:
        buf = np.zeros(SIZE, np.uint8)
        region = agent.register(buf)
        pv = agent.connect(victim.metadata)
        assert victim.call(cmd="connect", md=agent.metadata().hex()) == {"ok": True}
        fn = agent.read if op == "read" else agent.write
        theirs = expected_bytes(SIZE, 11)
        t0 = time.monotonic()
        ts: list = []
        snapshot: dict = {}

        def kill() -> None:  # from another thread, while a transfer is moving
            while len(ts) < 3 or ts[-1].status().done:  # kill while a transfer is in flight
                time.sleep(0.0005)
            victim.kill()
            snapshot["at"] = time.monotonic()

        killer = threading.Thread(target=kill)
        killer.start()
        states = []
        for _ in range(200):  # one transfer at a time, so each DONE can be checked byte for byte
            buf[:] = 0
            t = fn(pv, region.whole(), pv.regions[0].whole(), timeout=TIMEOUT)
            ts.append(t)
            st = t.wait()
            states.append(st)
            if st.ok and op == "read":
                assert np.array_equal(buf, theirs), "a READ reported DONE but its bytes are not intact"
            if not st.ok and "at" in snapshot:
                break
        killer.join()
        ended = time.monotonic()
        killed_at = snapshot["at"]
        failed = [s for s in states if not s.ok]
        assert failed, "no transfer failed although the peer was killed mid-transfer"
        # Detected by the backend, not by the core's deadline.
        assert ended - killed_at < TIMEOUT / 2, f"failures took {ended - killed_at:.1f}s after the kill"
        for s in failed:
            assert "deadline" not in s.reason, s.reason
            assert s.quiesced, f"failed transfer not quiesced: {s}"
        # A new transfer to the dead peer fails at once instead of hanging.
        late = fn(pv, region.segments([0], [4096]), pv.regions[0].segments([0], [4096]), timeout=TIMEOUT)
        st = late.wait()
        assert not st.ok and "deadline" not in st.reason, st
        assert time.monotonic() - t0 < TIMEOUT

        # The survivor keeps serving another peer, both as initiator and as target.
        other = PeerProcess("other", 1 << 20, seed=12, options=opts)
        po = agent.connect(other.metadata)
        assert other.call(cmd="connect", md=agent.metadata().hex()) == {"ok": True}
        buf[:] = 0
        t = agent.read(po, region.segments([0], [1 << 20]), po.regions[0].segments([0], [1 << 20]), timeout=TIMEOUT)
        assert t.wait().ok
        assert np.array_equal(buf[: 1 << 20], expected_bytes(1 << 20, 12))
        ans = other.call(cmd="write", local=[[0, 8192]], remote=[[1 << 21, 8192]], notify=b"still here".hex())
        assert ans["state"] == "DONE", ans
        assert np.array_equal(buf[1 << 21 : (1 << 21) + 8192], expected_bytes(1 << 20, 12)[:8192])
        deadline = time.monotonic() + 5
        notes: list = []
        while not notes and time.monotonic() < deadline:
            notes = agent.notifications()
            time.sleep(0.005)
        assert [(n.peer, n.payload) for n in notes] == [("other", b"still here")]
    finally:
        if other is not None:
            other.close()
        victim.close()
        agent.close()
