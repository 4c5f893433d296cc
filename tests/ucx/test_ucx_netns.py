"""Two ucx agents in two network namespaces joined by a veth pair: they can only talk over
that non-loopback link. The test makes the namespaces and removes them; it is skipped (with
the reason) where creating network namespaces is not permitted (no root, no iproute2)."""

from __future__ import annotations

import subprocess

import pytest

import netns_helpers
from ucx_helpers import SENTINEL, PeerProcess, expected_bytes, sha, skip_unless_ucx_usable

pytestmark = pytest.mark.timeout(120)

SIZE = 8 << 20
BLOCK = 64 << 10


def _counter(ns: str, dev: str, name: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/{name}"],
                         capture_output=True, text=True, timeout=20)
    return int(out.stdout.strip())


@pytest.fixture
def veth_namespaces():
    skip_unless_ucx_usable()
    with netns_helpers.veth_namespaces("kvt", "kv", ("10.213.77.1/24", "10.213.77.2/24")) as ends:
        yield ends


def test_agents_in_two_namespaces_move_bytes_over_veth(veth_namespaces):
    (ns_a, dev_a), (ns_b, dev_b) = veth_namespaces
    a = PeerProcess("ns-a", SIZE, seed=21, options={"tls": "tcp", "net_devices": dev_a},
                    prefix=["ip", "netns", "exec", ns_a])
    b = PeerProcess("ns-b", SIZE, seed=22, options={"tls": "tcp", "net_devices": dev_b},
                    prefix=["ip", "netns", "exec", ns_b])
    try:
        rx0 = _counter(ns_a, dev_a, "rx_bytes")
        assert a.call(cmd="connect", md=b.metadata.hex()) == {"ok": True}
        assert b.call(cmd="connect", md=a.metadata.hex()) == {"ok": True}
        mine, theirs = expected_bytes(SIZE, 21), expected_bytes(SIZE, 22)
        # a READs 16 scattered blocks of b into its first 16 blocks
        src = [(i * 7 % 128) * BLOCK for i in range(16)]
        ans = a.call(cmd="read", local=[[i * BLOCK, BLOCK] for i in range(16)],
                     remote=[[s, BLOCK] for s in src], notify=b"pulled".hex())
        assert ans["state"] == "DONE", ans
        assert a.call(cmd="sha", offsets=[i * BLOCK for i in range(16)], lengths=[BLOCK] * 16)["sha"] == \
            sha(theirs, src, [BLOCK] * 16)
        assert a.call(cmd="notify", payload=SENTINEL.hex()) == {"ok": True}
        assert b.notes_until() == [["ns-a", b"pulled".hex()], ["ns-a", SENTINEL.hex()]]
        # a WRITEs its last 32 blocks (still its original bytes) into b's blocks 64..95
        ans = a.call(cmd="write", local=[[(96 + i) * BLOCK, BLOCK] for i in range(32)],
                     remote=[[(64 + i) * BLOCK, BLOCK] for i in range(32)], notify=b"pushed".hex())
        assert ans["state"] == "DONE", ans
        assert a.call(cmd="notify", payload=SENTINEL.hex()) == {"ok": True}
        assert b.notes_until() == [["ns-a", b"pushed".hex()], ["ns-a", SENTINEL.hex()]]
        assert b.call(cmd="sha", offsets=[64 * BLOCK], lengths=[32 * BLOCK])["sha"] == \
            sha(mine, [96 * BLOCK], [32 * BLOCK])
        # The bytes really crossed the veth link (READ payload arrives on a's side).
        assert _counter(ns_a, dev_a, "rx_bytes") - rx0 >= 16 * BLOCK
    finally:
        a.close()
        b.close()
