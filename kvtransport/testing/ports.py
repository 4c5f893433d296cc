"""Free TCP ports for tests that start servers, chosen where the kernel never hands out
ports by itself.

A port found by binding port 0 comes from the kernel's ephemeral range, the range it also
draws from for every outgoing connection and every other ``bind(0)``. Between choosing such
a port and a server binding it, another socket can take it (seen in CI: "Address already in
use" for a side channel whose port was picked while UCX, ZMQ and vLLM opened connections).
Ports below that range are taken only by servers asking for them by number.

The last ranges handed out by this process are not handed out again: a test that picks
several ports before starting its servers (an engine pair and a proxy) would otherwise get
the same port twice now and then, since nothing binds them until the servers start. Only
recent ones: a long test session would otherwise run out of ports below the range.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from pathlib import Path

__all__ = ["free_port_range"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: the port ranges this process handed out last (not handed out again while listed)
_RECENT: deque[range] = deque(maxlen=64)
_LOCK = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_range(n: int = 1) -> int:
    """A port ``base`` with ``base .. base + n - 1`` free on every interface right now,
    below the kernel's ephemeral range (a side channel listens on base + TP rank)."""
    low = _ephemeral_low()
    lowest = max(1024, low - 12000)
    if low - n <= lowest:
        raise RuntimeError(f"the ephemeral port range starts at {low}: no room below it for {n} ports")
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lowest, low - n)
        ports = range(base, base + n)
        with _LOCK:
            if any(r.start < ports.stop and ports.start < r.stop for r in _RECENT):
                continue
            try:
                for port in ports:
                    with socket.socket() as s:
                        s.bind(("", port))  # every interface: workers with no host listen on all
            except OSError:
                continue
            _RECENT.append(ports)
            return base
    raise RuntimeError(f"no {n} consecutive free ports between {lowest} and {low}")
