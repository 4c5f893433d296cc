"""Two network namespaces joined by a veth pair, for tests whose agents must talk over a
real, non-loopback link they can cut. Used by ``tests/ucx/test_ucx_netns.py`` and
``tests/reliability/test_netns_link_cut.py`` (whose conftest puts ``tests/ucx`` on the
path, as it does for ``ucx_helpers``).

The namespaces, the link and its addresses exist only while the ``with`` block runs; the
test is skipped, with the reason, where they cannot be made (no iproute2, no root /
CAP_SYS_ADMIN).
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

#: One end of the link: (namespace name, device name inside it).
End = tuple[str, str]


def ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``, inside namespace ``ns`` when given; never raises on failure."""
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


@contextmanager
def veth_namespaces(ns_prefix: str, dev_prefix: str, addrs: tuple[str, str]) -> Iterator[tuple[End, End]]:
    """Namespaces ``{ns_prefix}-a-TAG`` and ``-b-TAG`` joined by veth devices
    ``{dev_prefix}aTAG`` / ``{dev_prefix}bTAG`` (TAG random, so runs never collide) with
    ``addrs`` (CIDR, one per end), both ends and their loopbacks up. Yields
    ``((ns_a, dev_a), (ns_b, dev_b))``; removes both namespaces (and so the veth pair)
    on exit, also when the body skips or fails."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 'ip' command not found; cannot create network namespaces")
    tag = secrets.token_hex(3)
    ns_a, ns_b = f"{ns_prefix}-a-{tag}", f"{ns_prefix}-b-{tag}"
    dev_a, dev_b = f"{dev_prefix}a{tag}", f"{dev_prefix}b{tag}"
    made: list[str] = []
    try:
        r = ip("netns", "add", ns_a)
        if r.returncode != 0:
            pytest.skip(f"cannot create a network namespace (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
        made.append(ns_a)
        assert ip("netns", "add", ns_b).returncode == 0
        made.append(ns_b)
        steps = [
            (None, ["link", "add", dev_a, "type", "veth", "peer", "name", dev_b]),
            (None, ["link", "set", dev_a, "netns", ns_a]),
            (None, ["link", "set", dev_b, "netns", ns_b]),
            # Addresses exist only inside the namespaces made here.
            (ns_a, ["addr", "add", addrs[0], "dev", dev_a]),
            (ns_b, ["addr", "add", addrs[1], "dev", dev_b]),
            (ns_a, ["link", "set", dev_a, "up"]),
            (ns_b, ["link", "set", dev_b, "up"]),
            (ns_a, ["link", "set", "lo", "up"]),
            (ns_b, ["link", "set", "lo", "up"]),
        ]
        for ns, args in steps:
            r = ip(*args, ns=ns)
            if r.returncode != 0:
                pytest.skip(f"cannot set up the veth pair ({' '.join(args)}): {r.stderr.strip()}")
        yield (ns_a, dev_a), (ns_b, dev_b)
    finally:
        for ns in made:
            ip("netns", "del", ns)  # removes the veth pair with it
