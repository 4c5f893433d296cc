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


def test_connector_hands_a_gpu_kv_cache_to_mori_as_gpu_memory_on_its_device(monkeypatch):
    """The vLLM worker's GPU KV tensors (kind and device read from the tensor) reach mori's
    register_memory as GPU memory on the tensor's device (FAKE mori.io: it then refuses, as
    it has no GPU; the refused worker closes its agent)."""
    torch = pytest.importorskip("torch")  # noqa: F841 - the connector needs torch's dtypes only
    from kvtransport_vllm.config import ConnectorConfig
    from kvtransport_vllm.worker import KVTransportWorker

    from .test_memory_kinds import NUM_BLOCKS, DeviceTensorLike, _free_port

    monkeypatch.setenv("KVTRANSPORT_SECRET", "0123456789abcdef0123456789abcdef")
    io = make_fake_mori_io()
    shape = (2, NUM_BLOCKS, 4, 2, 16)
    caches = {f"layer{i}": DeviceTensorLike("cuda", 2, UNMAPPED + i * (1 << 20), shape) for i in range(2)}
    cfg = ConnectorConfig.from_extra("kv_producer", "mori-gpu", {"backend": "moriio", "mode": "write",
                                                               "backend_options": {"host": "127.0.0.1"},
                                                               "side_channel_port": _free_port()})
    w = KVTransportWorker(cfg, 4, NUM_BLOCKS, "float16")
    seen = []
    real_cls = io.IOEngine

    class Recording(real_cls):
        def register_memory(self, ptr, size, dev, loc):
            seen.append((ptr, size, dev, loc))
            return super().register_memory(ptr, size, dev, loc)

    io.IOEngine = Recording
    with using_mori_module(io):
        with pytest.raises(Exception, match="fake mori: no GPU"):
            w.register_kv_caches(caches)
    nbytes = 2 * NUM_BLOCKS * 4 * 2 * 16 * 2
    assert seen == [(UNMAPPED, nbytes, 2, io.MemoryLocationType.GPU)]
    assert w.agent is None
