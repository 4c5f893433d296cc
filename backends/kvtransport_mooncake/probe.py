"""Can the ``mooncake`` backend run here, and if not, precisely why and how to fix it.

Checked in order, each with its own reason and install hint:

1. the ``mooncake`` package is installed (``mooncake-transfer-engine-non-cuda`` here, or the
   CUDA wheel ``mooncake-transfer-engine``);
2. ``mooncake.engine`` loads: it links system libraries the wheel does not bundle --
   ``libibverbs.so.1`` (even for the TCP transport), ``libnuma.so.1``, ``libcurl.so.4`` -- so a
   host without one fails here with the loader's message, mapped to the apt package;
3. ``engine.so`` exports the C++ status entry points this backend polls with (``abi``);
4. a Transfer Engine initialises with the peer-to-peer hand-shake on 127.0.0.1 over TCP
   (it binds two free ports and releases them). Done once per process and cached.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import threading
from typing import Any

from kvtransport.spi import Availability

from . import abi

PIP_HINT = "pip install 'kvtransport[mooncake]'  (installs mooncake-transfer-engine-non-cuda)"
#: System libraries ``mooncake/engine.so`` links (not bundled in the wheel) -> Debian/Ubuntu
#: package. libibverbs is needed even for the TCP transport.
SYSTEM_LIBS = {"libibverbs.so": "libibverbs1", "libnuma.so": "libnuma1", "libcurl.so": "libcurl4",
               "libnl-route-3.so": "libnl-route-3-200", "libnl-3.so": "libnl-3-200"}
APT_ALL = "apt-get install libibverbs1 libnuma1 libcurl4"


def load_engine_module():
    """Import ``mooncake.engine`` (raises ImportError/OSError with the loader's reason)."""
    import mooncake.engine as me

    return me


@functools.cache
def probe() -> Availability:
    if importlib.util.find_spec("mooncake") is None:
        return Availability(False, "the Python package 'mooncake' (Mooncake Transfer Engine) is not installed",
                            PIP_HINT)
    try:
        me = load_engine_module()
    except (ImportError, OSError) as exc:
        text = f"{type(exc).__name__}: {exc}"
        for lib, pkg in SYSTEM_LIBS.items():
            if lib in text:
                return Availability(
                    False, f"mooncake.engine cannot load the system library {lib}*: {text}",
                    f"apt-get install {pkg}  (Mooncake's engine.so links it even for TCP; all it needs: {APT_ALL})")
        if "shared object" in text:
            return Availability(False, f"mooncake.engine cannot load a system library: {text}", APT_ALL)
        return Availability(False, f"mooncake.engine cannot be imported: {text}", PIP_HINT)
    why = abi.check()
    if why:
        return Availability(False, why, "install mooncake-transfer-engine-non-cuda 0.3.13 (the version tested)")
    try:
        engine = me.TransferEngine()
        rc = initialize(engine, "127.0.0.1", "tcp", "")
        del engine
    except Exception as exc:  # a probe must not raise
        return Availability(False, f"a Mooncake Transfer Engine cannot be created: {type(exc).__name__}: {exc}")
    if rc != 0:
        return Availability(False, f"a Mooncake Transfer Engine does not initialise (P2PHANDSHAKE, tcp, "
                                   f"127.0.0.1): initialize() returned {rc}; see Mooncake's log on stderr "
                                   "(free TCP ports in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT are needed)")
    return Availability(True)


def rdma_devices(me: Any, device_name: str) -> list[str]:
    """RDMA devices Mooncake's topology discovery finds (filtered by ``device_name``)."""
    try:
        topo = json.loads(me.TransferEngine().get_local_topology(device_name or None))
    except Exception:  # no topology: no devices
        return []
    return sorted({hca for entry in topo.values() for group in entry for hca in group})


_ENV_LOCK = threading.Lock()


def initialize(engine: Any, hostname: str, protocol: str, device_name: str) -> int:
    """``engine.initialize`` with the transport actually chosen.

    The binding ignores its ``protocol`` argument when choosing the transport: Mooncake
    installs RDMA when topology discovery finds an RDMA device and TCP otherwise, unless
    ``MC_FORCE_TCP`` is set (read during ``initialize``). So ``protocol='tcp'`` sets it for
    the duration of the call (and restores it), and ``'rdma'`` is only used after
    :func:`rdma_devices` found a device.
    """
    with _ENV_LOCK:
        old = os.environ.get("MC_FORCE_TCP")
        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"
        else:
            os.environ.pop("MC_FORCE_TCP", None)
        try:
            return engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        finally:
            if old is None:
                os.environ.pop("MC_FORCE_TCP", None)
            else:
                os.environ["MC_FORCE_TCP"] = old
