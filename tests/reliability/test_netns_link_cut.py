"""Network faults across hosts (issue 7, point 5): two ucx agents in two network
namespaces joined by a veth pair (made by this test, addresses only inside them). The
link is cut (``ip link set down``) while a large READ is in flight: that transfer FAILS
within its deadline (T2) and is quiesced (T3); the link is restored: later transfers in
both directions succeed byte-exact; nothing is left pending or unquiesced.

Skipped, with the reason, where the ucx backend is unusable or network namespaces cannot
be created (no root / CAP_SYS_ADMIN, no iproute2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvtransport as kvt
from netns_helpers import ip, veth_namespaces  # tests/ucx, on the path by conftest
from ucx_helpers import expected_bytes, sha

pytestmark = pytest.mark.timeout(180)

SIZE = 64 << 20
SEG = 1 << 20
DEADLINE_S = 4.0
#: how long a wait may take before the test calls it hung (not a timing bound)
HANG_GUARD_S = 60.0
SCRIPT = Path(__file__).with_name("_netns_agent.py")


class Agent:
    """``_netns_agent.py`` in a namespace."""

    def __init__(self, ns: str, name: str, seed: int, dev: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parent), env.get("PYTHONPATH")]))
        opts = {"tls": "tcp", "net_devices": dev}
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(SCRIPT), name, str(SIZE),
                                      str(seed), json.dumps(opts)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.md = self._read()["md"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent ended (rc={self.proc.poll()}): {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def call(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(15)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def link():
    info = {b.name: b for b in kvt.available_backends()}
    if "ucx" not in info or not info["ucx"].usable:
        pytest.skip(f"ucx backend not usable here: {info.get('ucx') and info['ucx'].reason}")
    if shutil.which("tc") is None:
        pytest.skip("iproute2 'tc' not found; cannot shape the veth link")
    with veth_namespaces("kvt-cut", "kc", ("10.250.7.1/30", "10.250.7.2/30")) as ((ns_a, dev_a), (ns_b, dev_b)):
        # Slow the B -> A direction (READ payload) so the big READ is surely in flight when
        # the link goes down: 64 MiB at 200 Mbit/s takes ~2.7 s.
        r = subprocess.run(["ip", "netns", "exec", ns_b, "tc", "qdisc", "add", "dev", dev_b, "root", "tbf",
                            "rate", "200mbit", "burst", "64kb", "latency", "200ms"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            pytest.skip(f"cannot shape the veth link with tc: {r.stderr.strip()}")
        yield (ns_a, dev_a), (ns_b, dev_b)


def _segs(base: int, n: int) -> list[list[int]]:
    return [[base + i * SEG, SEG] for i in range(n)]


def test_link_cut_mid_transfer_fails_by_deadline_then_recovers(link):
    (ns_a, dev_a), (ns_b, dev_b) = link
    a = Agent(ns_a, "cut-a", 31, dev_a)
    b = Agent(ns_b, "cut-b", 32, dev_b)
    try:
        assert a.call(cmd="connect", md=b.md) == {"ok": True}
        assert b.call(cmd="connect", md=a.md) == {"ok": True}
        theirs = expected_bytes(SIZE, 32)

        # 1. a big READ (all 64 MiB), then the link goes down while it is in flight
        big = a.call(cmd="post", op="read", local=_segs(0, 64), remote=_segs(0, 64), timeout=DEADLINE_S)
        st = a.call(cmd="status", id=big["id"])
        assert st["state"] == "PENDING", f"the READ ended before the cut ({st}); slow the link more"
        assert ip("link", "set", dev_a, "down", ns=ns_a).returncode == 0
        st = a.call(cmd="wait", id=big["id"], limit=HANG_GUARD_S)
        assert st["state"] == "FAILED", st
        # T2: failed by its deadline at the latest: no progress call begun after the
        # deadline left it open (the transport may notice the cut earlier)
        assert not st["open_past_deadline"], f"still pending after its deadline had passed: {st}"
        # T3: quiesced (flush or forced endpoint close), nothing pending, nothing held aside
        stats = a.call(cmd="settle", limit=15)
        assert stats["pending"] == 0 and stats["unquiesced"] == 0, stats
        assert a.call(cmd="status", id=big["id"])["quiesced"] is True

        # 2. the link is restored: later transfers succeed, byte-exact, both directions
        assert ip("link", "set", dev_a, "up", ns=ns_a).returncode == 0
        rd = a.call(cmd="post", op="read", local=_segs(0, 8), remote=_segs(16 * SEG, 8), timeout=30)
        st = a.call(cmd="wait", id=rd["id"], limit=HANG_GUARD_S)
        assert st["state"] == "DONE", st
        assert a.call(cmd="sha", offsets=[0], lengths=[8 * SEG])["sha"] == sha(theirs, [16 * SEG], [8 * SEG])
        wr = a.call(cmd="post", op="write", local=_segs(0, 4), remote=_segs(40 * SEG, 4), timeout=30)
        st = a.call(cmd="wait", id=wr["id"], limit=HANG_GUARD_S)
        assert st["state"] == "DONE", st
        assert b.call(cmd="sha", offsets=[40 * SEG], lengths=[4 * SEG])["sha"] == sha(theirs, [16 * SEG], [4 * SEG])

        # 3. nothing leaks on either side
        sa, sb = a.call(cmd="settle", limit=10), b.call(cmd="settle", limit=10)
        assert sa["pending"] == sa["unquiesced"] == 0 and sb["pending"] == sb["unquiesced"] == 0, (sa, sb)
        assert sa["transfers_failed"] == 1 and sa["transfers_done"] == 2, sa
    finally:
        a.close()
        b.close()
