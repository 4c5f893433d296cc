"""Can the ``ucx`` backend run here: libucp loads (the bundled ``libucx-cu12`` wheel or a
system UCX) and is recent enough (>= 1.11, the ``ucp_*_nbx`` calls this backend uses)."""

from __future__ import annotations

from kvtransport.spi import Availability

from . import ucp as U

INSTALL_HINT = "pip install 'kvtransport[ucx]'  (installs libucx-cu12)"


def probe() -> Availability:
    """Whether libucp loads and is new enough; never raises."""
    try:
        lib = U.lib()
        major, minor = (int(x) for x in lib.version().split(".")[:2])
    except Exception as exc:
        return Availability(False, f"cannot load libucp: {exc}", INSTALL_HINT)
    if (major, minor) < (1, 11):
        return Availability(False, f"UCX {lib.version()} is too old (need >= 1.11)", INSTALL_HINT)
    return Availability(True)
