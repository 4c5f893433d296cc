"""UCX requests and the memory they use outlive nothing: a notification UCX is still
sending keeps its payload buffer after its transfer failed, and no request of a destroyed
worker is touched after close(). Real ucx agents in one process; a peer's progress is held
up by taking its lane locks (the progress thread cannot drain while they are held)."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np

import kvtransport as kvt
from ucx_helpers import skip_unless_ucx_usable

pytestmark = skip_unless_ucx_usable()


def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


def test_a_failed_transfer_keeps_its_notification_buffer_until_ucx_has_sent_it():
    """fail() freed the send request and the transfer was dropped at release(): UCX then read
    the freed payload buffer (a segmentation fault in the progress thread)."""
    src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
    payload = b"A" * (4 << 20)
    a = kvt.open("ucx", name="rl-a", tls="shm", lanes=1)
    b = kvt.open("ucx", name="rl-b", tls="shm", lanes=1)
    held = list(b._backend._w.lanes)
    for lane in held:
        lane.lock.acquire()  # b does not drain: the 4 MiB notification stays in flight
    try:
        ra, rb = a.register(src), b.register(dst)
        peer = a.connect(b.metadata())
        t = a.write(peer, ra.whole(), peer.region(rb.id).whole(), notify=payload, timeout=0.5)
        x = t.backend_handle
        _until(lambda: x.stage == "notify")
        buf = weakref.ref(x.am_bufs)
        st = t.wait(10)
        assert st.state is kvt.State.FAILED and "deadline" in st.reason
        t.release()
        t = x = None
        gc.collect()
        assert buf() is not None, "the payload buffer was freed while UCX still sends from it"
    finally:
        for lane in held:
            lane.lock.release()
    got: list = []
    _until(lambda: got.extend(b.notifications()) or got)
    assert got[0].payload == payload  # what UCX sent is the payload, not reused memory
    _until(lambda: buf() is None)  # freed once the send has ended
    a.close()
    b.close()


def test_no_request_of_a_destroyed_worker_is_touched_after_close():
    """err_mode="none": close() does not force endpoints closed, so a flush still pending after
    its 2 s wait was checked (and could be freed) on the destroyed worker by status()."""
    a = kvt.open("ucx", name="rl-c", tls="tcp", err_mode="none", lanes=1)
    b = kvt.open("ucx", name="rl-d", tls="tcp", err_mode="none", lanes=1)
    local, remote = np.zeros(1 << 20, np.uint8), np.ones(1 << 20, np.uint8)
    ra, rb = a.register(local), b.register(remote)
    peer = a.connect(b.metadata())
    assert a.read(peer, ra.whole(), peer.region(rb.id).whole()).wait(10).ok
    held = list(b._backend._w.lanes)
    for lane in held:
        lane.lock.acquire()  # b stalls: a's tcp get cannot complete
    try:
        t = a.read(peer, ra.whole(), peer.region(rb.id).whole())
        x = t.backend_handle
        _until(lambda: bool(x.flush))
        a.close()
        data = a._backend._data
        touched: list[str] = []
        real = data._ucp

        class Watch:  # records any request call made now that the workers are gone
            def __getattr__(self, name):
                fn = getattr(real, name)
                if name.startswith("ucp_request"):
                    touched.append(name)
                return fn
        data._ucp = Watch()
        st = t.status()
        assert st.state is kvt.State.FAILED and st.quiesced
        a._backend.release(x)
        assert touched == [], f"requests of a destroyed worker used: {touched}"
        assert not x.flush and x not in data.active
    finally:
        for lane in held:
            lane.lock.release()
        b.close()
