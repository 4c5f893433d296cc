"""Fixtures for the moriio glue tests: fresh FAKE mori.io namespaces and agents on them.

The fake (fake_mori_io.py) tests only our glue; see that module's docstring.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtransport.spi import LocalRegion, RemoteRegion
from kvtransport_moriio.backend import MoriioBackend, using_mori_module

from .fake_mori_io import make_fake_mori_io


@pytest.fixture
def fake_io():
    """A fresh fake mori.io namespace (own fabric, own call log)."""
    return make_fake_mori_io()


@pytest.fixture
def fake_io_active(fake_io):
    """The fake, also installed through the module-level seam for code that goes
    through ``kvt.open`` (the core probes the backend class before constructing it)."""
    with using_mori_module(fake_io):
        yield fake_io


class Side:
    """One MoriioBackend driven directly through the SPI, with numpy buffers."""

    def __init__(self, name: str, io, sizes=(1 << 16,), first_id: int = 1, **opts):
        self.name = name
        self.be = MoriioBackend(name, {"mori_module": io, "host": "127.0.0.1", **opts})
        self.bufs: list[np.ndarray] = []
        self.regions: list[LocalRegion] = []
        self.blobs: list[bytes] = []
        rng = np.random.default_rng(abs(hash(name)) % (1 << 32))
        for i, n in enumerate(sizes):
            buf = rng.integers(0, 256, n, dtype=np.uint8)
            region = LocalRegion(first_id + i, int(buf.ctypes.data), int(buf.nbytes))
            self.bufs.append(buf)
            self.regions.append(region)
            self.blobs.append(self.be.register(region))

    def remote_view(self) -> list[RemoteRegion]:
        return [RemoteRegion(r.id, r.addr, r.length, r.kind, b) for r, b in zip(self.regions, self.blobs)]

    def connect(self, other: Side):
        return self.be.connect(other.name, other.be.export(), other.remote_view())


@pytest.fixture
def sides(fake_io):
    a = Side("a", fake_io, sizes=(1 << 16, 1 << 16), first_id=1)
    b = Side("b", fake_io, sizes=(1 << 16, 1 << 16), first_id=10)
    pa_b = a.connect(b)
    pb_a = b.connect(a)
    yield a, b, pa_b, pb_a
    a.be.close()
    b.be.close()
