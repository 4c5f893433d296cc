"""moriio's row of the memory-kind table, on the FAKE mori.io (tests our glue, not mori).

moriio declares cpu, cuda and rocm. A device region passes the core's kind gate and reaches
mori's ``register_memory`` as GPU memory on its device index; the fake has no GPU and
refuses it afterwards, which is the fake's limit, not the backend's.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport_moriio.backend import using_mori_module

from moriio.fake_mori_io import make_fake_mori_io  # tests/ is on sys.path (rootdir-relative packages)

UNMAPPED = 0x10_0000


@pytest.mark.parametrize("kind,device", [("cuda", 1), ("rocm", 2)])
def test_moriio_passes_device_regions_to_mori_as_gpu_memory(monkeypatch, kind, device):
    io = make_fake_mori_io()
    with using_mori_module(io):
        a = kvt.open("moriio", host="127.0.0.1")
        try:
            engine = a._backend._engine
            seen = []
            real = engine.register_memory
            monkeypatch.setattr(engine, "register_memory",
                                lambda ptr, size, dev, loc: (seen.append((ptr, size, dev, loc)), real(ptr, size, dev, loc))[1])
            assert a.register(np.zeros(4096, np.uint8)).kind == "cpu"
            with pytest.raises(Exception, match="fake mori: no GPU"):
                a.register((UNMAPPED, 4096), kind=kind, device=device)
            assert seen[0][2:] == (-1, io.MemoryLocationType.CPU)
            assert seen[1] == (UNMAPPED, 4096, device, io.MemoryLocationType.GPU)
        finally:
            a.close()
