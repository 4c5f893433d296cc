"""What a nixl agent exports, and what we keep per connected peer.

The export blob is decoded strictly (msgspec, unknown fields refused): NIXL's own agent
metadata travels inside it as opaque bytes, which NIXL's deserializer checks when we load
it (``add_remote_agent``); a corrupt one is refused with ``NIXL_ERR_MISMATCH``.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence

import msgspec

from kvtransport.errors import PeerMetadataError
from kvtransport.process_identity import ProcessIdentity
from kvtransport.spi import RemoteRegion

from ._xfer import Xfer

#: One process environment: UCX_* settings are applied while one plugin starts at a time.
_ENV_LOCK = threading.Lock()


class Export(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Agent-level blob: NIXL's metadata and who we are (for same-host liveness checks)."""

    v: int
    nixl_name: str
    nixl_md: bytes
    plugins: list[str]
    pid: int
    start_time: int
    boot_id: str
    pid_ns: str


ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(Export)

#: A region's blob: empty for CPU memory (DRAM, device 0); for device memory (VRAM) the
#: device index it was registered on, which NIXL needs in the peer's transfer descriptors
#: (NIXL finds a remote region by device and address).
_DEV = struct.Struct("<I")


def region_blob(kind: str, dev: int) -> bytes:
    return b"" if kind == "DRAM" else _DEV.pack(dev)


def region_device(peer_name: str, r: RemoteRegion) -> int:
    """The NIXL device index of a peer's region, from its blob (strict)."""
    if r.kind == "cpu" and not r.blob:
        return 0
    if r.kind == "cuda" and len(r.blob) == _DEV.size:
        return _DEV.unpack(r.blob)[0]
    raise PeerMetadataError(f"nixl peer {peer_name!r}: region {r.id} ({r.kind}) has a malformed blob "
                            f"({len(r.blob)} bytes)")


class Conn:
    """A loaded remote NIXL agent and what we know about its process."""

    def __init__(self, name: str, exp: Export, regions: Sequence[RemoteRegion]) -> None:
        self.name = name
        self.nixl_name = exp.nixl_name
        self.ident = ProcessIdentity(exp.pid, exp.start_time, exp.boot_id, exp.pid_ns)
        self.remote_kinds = {r.id: r.kind for r in regions}
        self.remote_devs = {r.id: region_device(name, r) for r in regions}
        self.all_cpu = all(k == "cpu" for k in self.remote_kinds.values())
        #: Check the process only for a same-host peer in another process.
        self.watch = exp.pid != os.getpid() and self.ident.checkable_here()
        self.next_check = 0.0
        self.failed: str | None = None
        self.dead = False  # its process is confirmed gone
        self.gone = False  # disconnected by the core
        self.xfers: set[Xfer] = set()


@contextlib.contextmanager
def ucx_env(settings: Mapping[str, str]) -> Iterator[None]:
    """UCX_* variables set while NIXL's UCX plugin reads them (plugin start), then restored.
    NIXL has no per-agent UCX configuration call, so this is the only way to choose
    transports per agent."""
    if not settings:
        yield
        return
    with _ENV_LOCK:
        saved = {k: os.environ.get(f"UCX_{k}") for k in settings}
        os.environ.update({f"UCX_{k}": v for k, v in settings.items()})
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(f"UCX_{k}", None)
                else:
                    os.environ[f"UCX_{k}"] = v
