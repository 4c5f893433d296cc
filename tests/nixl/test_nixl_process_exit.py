"""A process that used a nixl agent exits cleanly.

NIXL's bundled UCX ib modules link their own copy of libnl-route; on a host that also has
the system's libibverbs (Mooncake needs it) both copies load and the process died with
SIGSEGV in libnl-route's destructor at exit (exit code 139) -- after every agent was
closed, so a test suite that used nixl "passed" and then failed with 139. The backend
leaves the ib modules out where there is no RDMA device (``_probe.NO_RDMA_MODULES``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvtransport.testing.required import skip_unless_usable

SCRIPT = """
import numpy as np
import kvtransport as kvt
a = kvt.open("nixl", name="exit-a")
b = kvt.open("nixl", name="exit-b")
src = a.register(np.arange(1 << 16, dtype=np.uint8))
dst = b.register(np.zeros(1 << 16, dtype=np.uint8))
peer = b.connect(a.metadata())
t = b.read(peer, dst.whole(), peer.region(src.id).whole(), timeout=10.0)
assert t.wait().ok
a.close(); b.close()
print("closed")
"""


def test_process_that_used_nixl_exits_with_status_zero() -> None:
    skip_unless_usable("nixl")
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert "closed" in r.stdout, r.stderr[-2000:]
    assert r.returncode == 0, f"exit status {r.returncode} after a clean close: {r.stderr[-2000:]}"
