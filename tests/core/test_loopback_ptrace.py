"""Loopback names as ptracer only the peer that asked, only under Yama ptrace_scope=1.

Cross-memory attach into a process needs ptrace-attach permission on it. Under Yama
scope 1 the *target* must name the accessing process with PR_SET_PTRACER (one pid at a
time); loopback used to name ANY process at open. Now a connecting peer sends an
authenticated attach request (pid, start time, boot id) and the target names that
process, re-granting whoever asks again after an EPERM.

Two kinds of tests:

* decisions, which run everywhere: the policy and the agents' wiring, with the prctl
  call replaced by a recorder (the seam ``kvtransport_loopback.ptrace.set_ptracer``) and
  the Yama scope forced to 1 — which pid is granted when, that nothing is granted at
  open, that an unauthenticated attach request grants nothing;
* the kernel's behaviour, which needs Yama with ptrace_scope=1: a sibling process that
  connected can copy, one that did not connect gets EPERM (with the old ANY grant it
  could copy). Skipped, with the reason, on kernels without Yama (this CI machine has
  none: /proc/sys/kernel/yama/ptrace_scope is absent).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

import kvtransport as kvt
import kvtransport_loopback.backend as lb
import kvtransport_loopback.ptrace as pt
from kvtransport.auth import Authenticator
from kvtransport.metadata import decode_metadata
from kvtransport.notify import CHANNEL, new_notification_key
from kvtransport.process_identity import ProcessIdentity, boot_id, pid_namespace, process_start_time
from kvtransport_loopback import cma
from kvtransport_loopback.wire import CODEC

TARGET = """
import sys, numpy as np
if sys.argv[1] == "fake-yama":
    import kvtransport_loopback.backend as lb, kvtransport_loopback.ptrace as pt
    lb.yama_scope = lambda: 1
    def record(pid):
        sys.stdout.write(f"GRANT {pid}\\n"); sys.stdout.flush()
    pt.set_ptracer = record
import kvtransport as kvt
a = kvt.open("loopback", name="target")
buf = np.arange(4096, dtype=np.uint32).view(np.uint8)
a.register(buf)
sys.stdout.write(f"META {a.metadata().hex()} {buf.ctypes.data}\\n"); sys.stdout.flush()
sys.stdin.read()
"""

INITIATOR = """
import sys, numpy as np, kvtransport as kvt
a = kvt.open("loopback", name=sys.argv[2])
dst = np.zeros(4 * 4096, np.uint8)
r = a.register(dst)
peer = a.connect(bytes.fromhex(sys.argv[1]))
st = a.read(peer, r.whole(), peer.regions[0].whole(), timeout=20).wait(30)
ok = st.ok and np.array_equal(dst.view(np.uint32), np.arange(4096, dtype=np.uint32))
sys.stdout.write("READ " + ("ok" if ok else "failed: " + st.reason) + "\\n"); sys.stdout.flush()
sys.stdin.read()
"""

OUTSIDER = """
import sys, numpy as np
from kvtransport_loopback import cma
pid, addr = int(sys.argv[1]), int(sys.argv[2])
dst = np.zeros(64, np.uint8)
try:
    cma.copy_segments("read", pid, np.array([dst.ctypes.data], np.uint64),
                      np.array([addr], np.uint64), np.array([64], np.uint64))
    print("COPIED", flush=True)
except cma.CmaError as e:
    print("ERRNO", e.errno, flush=True)
"""


class Child:
    """A Python child whose stdout lines are read on a thread (so waits have deadlines)."""

    def __init__(self, code: str, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 20.0) -> str:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            assert left > 0, f"child {self.pid} printed no {prefix!r} line"
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, process_start_time(self.pid), boot_id(), pid_namespace())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def children():
    made: list[Child] = []
    yield lambda code, *args: made.append(Child(code, *args)) or made[-1]
    for c in made:
        c.close()


SLEEPER = "import sys; print('UP', flush=True); sys.stdin.read()"


# ----------------------------------------------------------------------------- decisions (run everywhere)
def test_policy_grants_only_under_scope_1_and_to_the_requester(children, caplog):
    c1, c2 = children(SLEEPER), children(SLEEPER)
    c1.expect("UP"), c2.expect("UP")
    for scope, outcome in ((None, pt.Grant.NOT_NEEDED), (0, pt.Grant.NOT_NEEDED),
                           (2, pt.Grant.IMPOSSIBLE), (3, pt.Grant.IMPOSSIBLE)):
        calls: list[int] = []
        policy = pt.PtracerPolicy(scope, prctl=calls.append, slot=pt.PtracerSlot())
        assert policy.on_attach_request(c1.identity()) is outcome and calls == []
    calls = []
    policy = pt.PtracerPolicy(1, prctl=calls.append, slot=pt.PtracerSlot())
    assert policy.needs_grant
    assert policy.on_attach_request(c1.identity()) is pt.Grant.GRANTED
    assert policy.on_attach_request(c1.identity()) is pt.Grant.ALREADY  # no redundant prctl
    assert policy.on_attach_request(c2.identity()) is pt.Grant.GRANTED  # one pid at a time
    assert policy.on_attach_request(c1.identity()) is pt.Grant.GRANTED  # re-granted when it asks again
    assert calls == [c1.pid, c2.pid, c1.pid] and policy.grants == 3
    # Never a recycled pid, another boot's process, or a dead one.
    ident = c2.identity()
    recycled = ProcessIdentity(ident.pid, ident.start_time + 1, ident.boot_id, ident.pid_ns)
    other_boot = ProcessIdentity(ident.pid, ident.start_time, "00000000-other-boot", ident.pid_ns)
    assert policy.on_attach_request(recycled) is pt.Grant.REFUSED
    assert policy.on_attach_request(other_boot) is pt.Grant.REFUSED
    c2.close()
    assert policy.on_attach_request(ident) is pt.Grant.REFUSED
    assert calls == [c1.pid, c2.pid, c1.pid]
    # ANY only when asked for, once, with a warning.
    # Two agents of one process share its single ptracer slot: when the other agent named
    # someone else, this one re-grants its peer instead of believing it still holds it.
    slot, calls = pt.PtracerSlot(), []
    x = pt.PtracerPolicy(1, prctl=calls.append, slot=slot)
    y = pt.PtracerPolicy(1, prctl=calls.append, slot=slot)
    assert x.on_attach_request(c1.identity()) is pt.Grant.GRANTED
    assert y.on_attach_request(c1.identity()) is pt.Grant.ALREADY  # the process already names c1
    c3 = children(SLEEPER)
    c3.expect("UP")
    assert y.on_attach_request(c3.identity()) is pt.Grant.GRANTED
    assert x.on_attach_request(c1.identity()) is pt.Grant.GRANTED
    assert calls == [c1.pid, c3.pid, c1.pid]
    calls = []
    policy = pt.PtracerPolicy(1, mode="any", prctl=calls.append, slot=pt.PtracerSlot())
    with caplog.at_level(logging.WARNING, logger="kvtransport_loopback.ptrace"):
        assert policy.on_attach_request(c1.identity()) is pt.Grant.ANY
    assert policy.on_attach_request(c1.identity()) is pt.Grant.ALREADY
    assert calls == [pt.PR_SET_PTRACER_ANY]
    assert any("PR_SET_PTRACER_ANY" in r.getMessage() for r in caplog.records)
    with pytest.raises(kvt.errors.BackendOptionError, match="ptrace_grant"):
        kvt.open("loopback", name="bad", ptrace_grant="everyone")


def test_nothing_granted_at_open_and_unauthenticated_attach_grants_nothing(children, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(lb, "yama_scope", lambda: 1)
    monkeypatch.setattr(pt, "set_ptracer", calls.append)
    live = children(SLEEPER)
    live.expect("UP")
    with kvt.open("loopback", name="target-in-process") as target:
        assert calls == []  # opening an agent names no ptracer (it used to name ANY)
        assert target.describe()["ptrace_scope"] == 1
        key = CODEC.decode(decode_metadata(target.metadata()).blob).notify_key
        ident = live.identity()
        body = msgspec.msgpack.encode((1, "attach", "forger", msgspec.msgpack.encode(
            [ident.pid, ident.start_time, ident.boot_id, ident.pid_ns])))
        with zmq.Context.instance().socket(zmq.PUSH) as push:
            push.connect(target.describe()["notify_addr"])
            push.send(body)  # unsealed
            push.send(Authenticator(new_notification_key(), CHANNEL).seal(body))  # a forger's key
            push.send(Authenticator(key, CHANNEL).seal(body))  # sentinel: sealed by a metadata holder
            end = time.monotonic() + 20
            while not calls and time.monotonic() < end:
                time.sleep(0.005)
        assert calls == [live.pid]  # only the sentinel's request was honoured
        assert target.describe()["notification_refusals"] == 2


def test_connecting_peers_are_granted_in_turn_and_regranted_after_eperm(children, monkeypatch):
    """A target (child, Yama scope forced to 1, prctl recorded) is granted to each process
    that connects; an initiator whose copy is refused with EPERM asks again and succeeds."""
    target = children(TARGET, "fake-yama")
    meta_hex, _addr = target.expect("META").split()
    monkeypatch.setattr(lb, "yama_scope", lambda: 1)  # this process acts as initiator under scope 1
    with kvt.open("loopback", name="initiator-1") as a:
        if not a.describe()["cross_process"]:
            pytest.skip(f"cross-process loopback unavailable: {a.describe()['cross_process_reason']}")
        dst = np.zeros(4 * 4096, np.uint8)
        r = a.register(dst)
        peer = a.connect(bytes.fromhex(meta_hex))
        assert int(target.expect("GRANT")) == os.getpid()
        assert a.read(peer, r.whole(), peer.regions[0].whole()).wait(20).ok
        assert np.array_equal(dst.view(np.uint32), np.arange(4096, dtype=np.uint32))
        # A second initiator connects: the target names it instead (one pid at a time).
        other = children(INITIATOR, meta_hex, "initiator-2")
        assert int(target.expect("GRANT")) == other.pid
        assert other.expect("READ") == "ok"
        # Our next copy is refused once with EPERM (what the kernel does now that the grant
        # moved): we ask again, the target re-grants us, the retried copy moves the bytes.
        real, refused = cma.copy_segments, []

        def eperm_once(*args, **kw):
            if not refused:
                refused.append(1)
                raise cma.CmaError(errno.EPERM, "Operation not permitted")
            return real(*args, **kw)

        monkeypatch.setattr(cma, "copy_segments", eperm_once)
        dst[:] = 0
        assert a.read(peer, r.whole(), peer.regions[0].whole()).wait(20).ok
        assert refused == [1] and np.array_equal(dst.view(np.uint32), np.arange(4096, dtype=np.uint32))
        assert int(target.expect("GRANT")) == os.getpid()


# ----------------------------------------------------------------------------- the kernel (needs Yama)
def test_yama_scope_1_only_the_connected_peer_can_copy(children):
    scope = pt.yama_scope()
    if scope is None:
        pytest.skip("this kernel has no Yama LSM (/proc/sys/kernel/yama/ptrace_scope absent): "
                    "PR_SET_PTRACER scoping cannot be observed here; the decisions are tested above")
    if scope != 1:
        pytest.skip(f"kernel.yama.ptrace_scope={scope}: PR_SET_PTRACER matters only at scope 1")
    # Target, initiator and outsider are siblings: none is an ancestor of the target
    # (Yama lets ancestors attach anyway), so only PR_SET_PTRACER can let one in.
    target = children(TARGET, "real")
    meta_hex, addr = target.expect("META").split()
    initiator = children(INITIATOR, meta_hex, "initiator")
    assert initiator.expect("READ") == "ok"
    outsider = children(OUTSIDER, str(target.pid), addr)
    assert outsider.expect("") == f"ERRNO {errno.EPERM}"  # with the old PR_SET_PTRACER_ANY: COPIED
