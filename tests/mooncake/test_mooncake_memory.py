"""Registration on Mooncake, which refuses a buffer overlapping one it already has: a region
inside a registered buffer shares it and moves bytes; one that partly overlaps or encloses a
registered buffer is refused with a typed error naming the fix; the Mooncake buffer is only
unregistered when its last region goes (a peer can still reach the remaining region)."""

from __future__ import annotations

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.testing.required import skip_unless_usable


@pytest.fixture
def pair():
    skip_unless_usable("mooncake")
    a = kvt.open("mooncake", name="mem-a")
    b = kvt.open("mooncake", name="mem-b")
    yield a, b
    a.close()
    b.close()


def test_nested_regions_share_a_registration_and_overlaps_are_refused(pair):
    a, b = pair
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    whole = b.register(src[: 512 << 10])
    inner = b.register(src[4096:8192])  # inside `whole`: shares its Mooncake buffer
    with pytest.raises(errors.InvalidSegmentsError, match="partly overlaps or contains"):
        b.register(src)  # encloses `whole`
    with pytest.raises(errors.InvalidSegmentsError, match="partly overlaps or contains"):
        b.register(src[(512 << 10) - 4096: (512 << 10) + 4096])  # straddles its end

    dst = np.zeros(8192, np.uint8)
    dr = a.register(dst)
    peer = a.connect(b.metadata())
    t = a.read(peer, dr.segments([0], [4096]), peer.region(inner.id).segments([0], [4096]))
    assert t.wait(30).ok, t.status()
    assert np.array_equal(dst[:4096], src[4096:8192])

    # The outer region goes; the Mooncake buffer stays while `inner` uses it.
    b.deregister(whole)
    peer = a.connect(b.metadata())
    t = a.read(peer, dr.segments([4096], [4096]), peer.region(inner.id).segments([0], [4096]))
    assert t.wait(30).ok, t.status()
    assert np.array_equal(dst[4096:], src[4096:8192])
    b.deregister(inner)
    again = b.register(src)  # nothing registered any more: the enclosing buffer is accepted
    b.deregister(again)


def test_close_releases_the_engine_and_its_port():
    """After ``close`` the engine is destroyed: its hand-shake port refuses connections."""
    import socket

    skip_unless_usable("mooncake")
    agent = kvt.open("mooncake", name="mem-close")
    agent.register(np.zeros(4096, np.uint8))
    host, port = agent.describe()["session"].rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()  # listening while open
    agent.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5)
