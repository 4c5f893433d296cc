"""Can the ``loopback`` backend run here: always between agents of one process; across
processes where the kernel lets us use cross-memory attach (``cma``)."""

from __future__ import annotations

from kvtransport.spi import Availability

from . import cma


def probe() -> Availability:
    ok, reason = cma.cma_available()
    if ok:
        return Availability(True)
    # Still usable between agents of one process; say what is missing.
    return Availability(True, f"in-process only: {reason}")
