"""Two ucx agents in two network namespaces joined by a veth pair: they can only talk over
that non-loopback link. The test makes the namespaces and removes them; it is skipped (with
the reason) where creating network namespaces is not permitted (no root, no iproute2)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import kvtransport as kvt
from ucx_helpers import PeerProcess, expected_bytes, sha

pytestmark = pytest.mark.timeout(120)

SIZE = 8 << 20
BLOCK = 64 << 10


def _ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


def _counter(ns: str, dev: str, name: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/{name}"],
                         capture_output=True, text=True, timeout=20)
    return int(out.stdout.strip())


@pytest.fixture
def veth_namespaces():
    info = {b.name: b for b in kvt.available_backends()}
    if "ucx" not in info or not info["ucx"].usable:
        pytest.skip(f"ucx backend not usable here: {info.get('ucx') and info['ucx'].reason}")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 'ip' command not found; cannot create network namespaces")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"kvt-a-{tag}", f"kvt-b-{tag}"
    dev_a, dev_b = f"kva{tag}", f"kvb{tag}"
    made: list[str] = []
    try:
        r = _ip("netns", "add", ns_a)
        if r.returncode != 0:
            pytest.skip(f"cannot create a network namespace (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
        made.append(ns_a)
        assert _ip("netns", "add", ns_b).returncode == 0
        made.append(ns_b)
        steps = [
            (None, ["link", "add", dev_a, "type", "veth", "peer", "name", dev_b]),
            (None, ["link", "set", dev_a, "netns", ns_a]),
            (None, ["link", "set", dev_b, "netns", ns_b]),
            # Addresses exist only inside the namespaces this test created.
            (ns_a, ["addr", "add", "10.213.77.1/24", "dev", dev_a]),
            (ns_b, ["addr", "add", "10.213.77.2/24", "dev", dev_b]),
            (ns_a, ["link", "set", dev_a, "up"]),
            (ns_b, ["link", "set", dev_b, "up"]),
            (ns_a, ["link", "set", "lo", "up"]),
            (ns_b, ["link", "set", "lo", "up"]),
        ]
        for ns, args in steps:
            r = _ip(*args, ns=ns)
            if r.returncode != 0:
                pytest.skip(f"cannot set up the veth pair ({' '.join(args)}): {r.stderr.strip()}")
        yield (ns_a, dev_a), (ns_b, dev_b)
    finally:
        for ns in made:
            _ip("netns", "del", ns)  # removes the veth pair with it


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
        assert b.call(cmd="notifications", wait=1)["notes"] == [["ns-a", b"pulled".hex()]]
        # a WRITEs its last 32 blocks (still its original bytes) into b's blocks 64..95
        ans = a.call(cmd="write", local=[[(96 + i) * BLOCK, BLOCK] for i in range(32)],
                     remote=[[(64 + i) * BLOCK, BLOCK] for i in range(32)], notify=b"pushed".hex())
        assert ans["state"] == "DONE", ans
        assert b.call(cmd="notifications", wait=1)["notes"] == [["ns-a", b"pushed".hex()]]
        assert b.call(cmd="sha", offsets=[64 * BLOCK], lengths=[32 * BLOCK])["sha"] == \
            sha(mine, [96 * BLOCK], [32 * BLOCK])
        # The bytes really crossed the veth link (READ payload arrives on a's side).
        assert _counter(ns_a, dev_a, "rx_bytes") - rx0 >= 16 * BLOCK
    finally:
        a.close()
        b.close()
