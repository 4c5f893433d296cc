"""Killing a peer process mid-transfer fails its transfers before their deadline (the backend
detects it: tcp endpoint error, or the pid liveness check for shared memory), and the
surviving agent keeps serving another peer in both directions.

"Before the deadline" is checked as facts the core records, not with a stopwatch: the
reason names the peer's failure (not the deadline) and the transfer's ``finished_at`` is
earlier than its ``deadline``. How fast the failure is noticed is measured in
bench/test_bench_ucx_timing.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kvtransport as kvt
from ucx_helpers import SENTINEL, TLS_OPTIONS, PeerProcess, expected_bytes, notes_until, skip_unless_ucx_usable

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
        ts: list = []
        snapshot: dict = {}

        def kill() -> None:  # from another thread, while a transfer is moving
            while len(ts) < 3 or ts[-1].status().done:  # kill while a transfer is in flight
                time.sleep(0.0005)
            victim.kill()
            snapshot["at"] = True  # the kill happened: a failure from now on ends the loop

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
        failed = [(t, s) for t, s in zip(ts, states) if not s.ok]
        assert failed, "no transfer failed although the peer was killed mid-transfer"
        # Detected by the backend (the reason names the peer's failure), not by the core's
        # deadline, and ended before that deadline by the core's own clock.
        for t, s in failed:
            assert "deadline" not in s.reason and "victim" in s.reason, s.reason
            assert t.finished_at < t.deadline, (t.finished_at, t.deadline)
            # T3 (docs/LIFECYCLE.md): FAILED may be seen before quiesced (a lane thread still
            # holding its share of the transfer); quiesced must follow, before the deadline.
            while not t.status().quiesced and time.monotonic() < t.deadline:
                time.sleep(0.001)
            assert t.status().quiesced, f"failed transfer never quiesced: {t.status()}"
        # A new transfer to the dead peer fails instead of hanging until its deadline.
        late = fn(pv, region.segments([0], [4096]), pv.regions[0].segments([0], [4096]), timeout=TIMEOUT)
        st = late.wait()
        assert not st.ok and "deadline" not in st.reason and "victim" in st.reason, st
        assert late.finished_at < late.deadline

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
        assert other.call(cmd="notify", payload=SENTINEL.hex()) == {"ok": True}
        assert notes_until(agent) == [("other", b"still here"), ("other", SENTINEL)]
    finally:
        if other is not None:
            other.close()
        victim.close()
        agent.close()
