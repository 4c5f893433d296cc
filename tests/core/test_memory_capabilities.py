"""Local and remote memory kinds are two capabilities.

What an agent can *register* (its own memory, touched by its own transport) and what a
*peer* may export for it to read or write are different questions. On ucx and nixl the
peer's memory is reached through the peer's own registration (its rkey / its NIXL
metadata), so a CPU-only agent -- a decode host without a GPU, ``kvtransport doctor`` run
from a laptop -- must pair with a GPU engine that exports ``cuda`` KV caches. Loopback
copies both sides on the CPU and must keep refusing such a peer, saying why.

No GPU exists here, so the GPU engine is a real second agent of the same backend whose
region is exported the way a GPU engine exports one: metadata ``kind`` "cuda" and, for
nixl, the region blob its backend writes for VRAM (the device index), built with the
backend's own function. The rest of the metadata (addresses, rkey, NIXL agent metadata,
process identity) is the real peer's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport import metadata as md_mod
from kvtransport.spi import Capabilities, Op
from kvtransport.testing.required import skip_unless_usable

NBYTES = 1 << 16
DEVICE = 3


def exported_as_gpu_engine(metadata: bytes, backend: str) -> bytes:
    """``metadata`` with every region exported as device memory on ``DEVICE``, as that
    backend's agent on a GPU host exports it."""
    md = md_mod.decode_metadata(metadata)
    if backend == "nixl":
        from kvtransport_nixl.wire import region_blob

        def blob(r: md_mod.RegionDesc) -> bytes:
            return region_blob("VRAM", DEVICE)
    else:  # ucx: the packed rkey; loopback: no per-region blob
        def blob(r: md_mod.RegionDesc) -> bytes:
            return r.blob
    fields = {f: getattr(md, f) for f in md.__struct_fields__}
    fields["regions"] = [md_mod.RegionDesc(r.id, r.addr, r.length, "cuda", blob(r)) for r in md.regions]
    return md_mod.encode_metadata(md_mod.AgentMetadata(**fields))


@pytest.fixture
def opened():
    agents: list[kvt.Agent] = []

    def open_(backend: str, name: str, **options) -> kvt.Agent:
        a = kvt.open(backend, name=name, **options)
        agents.append(a)
        return a

    yield open_
    for a in agents:
        a.close()


@pytest.mark.parametrize("backend,options", [
    ("ucx", {"tls": "tcp"}),
    ("ucx", {"tls": "shm"}),
    ("nixl", {}),
], ids=["ucx-tcp", "ucx-shm", "nixl"])
def test_cpu_only_agent_pairs_with_a_peer_exporting_cuda(opened, backend, options):
    skip_unless_usable(backend)
    gpu_engine = opened(backend, "gpu-engine", **options)
    exported = gpu_engine.register(np.ones(NBYTES, np.uint8))
    cpu_host = opened(backend, "cpu-host", **options)
    dst = np.zeros(NBYTES, np.uint8)
    local = cpu_host.register(dst)
    with pytest.raises(errors.UnsupportedMemoryKindError):
        cpu_host.register((0x10_0000, 4096), kind="cuda", device=0)  # no device memory of its own here

    peer = cpu_host.connect(exported_as_gpu_engine(gpu_engine.metadata(), backend))
    remote = peer.region(exported.id)
    assert remote.kind == "cuda"
    for op in (Op.READ, Op.WRITE):
        prepared = cpu_host.prepare(op, peer, local.segments([0, 8192], [4096, 4096]),
                                    remote.segments([4096, 0], [4096, 4096]))
        assert (prepared.nbytes, prepared.peer) == (8192, peer)
    assert cpu_host.stats()["peers_refused"] == 0


def test_loopback_still_refuses_a_peer_exporting_cuda_naming_the_problem(opened):
    gpu_engine = opened("loopback", "gpu-engine")
    gpu_engine.register(np.zeros(NBYTES, np.uint8))
    cpu_host = opened("loopback", "cpu-host")
    with pytest.raises(errors.UnsupportedMemoryKindError) as ei:
        cpu_host.connect(exported_as_gpu_engine(gpu_engine.metadata(), "loopback"))
    msg = str(ei.value)
    assert "'loopback' cannot connect to peer 'gpu-engine' exporting 'cuda' memory" in msg, msg
    assert "ucx" in [a.split(" ")[0] for a in ei.value.alternatives], msg  # those that can, named
    assert "loopback" not in [a.split(" ")[0] for a in ei.value.alternatives], msg
    assert cpu_host.peers == {} and cpu_host.stats()["peers_refused"] == 1


def test_declared_remote_kinds_default_to_local_ones():
    """A backend that declares no remote kinds accepts from peers only what it registers
    itself (nothing loosens for third-party backends), and narrowing the local kinds of a
    declared set leaves its remote kinds as declared."""
    assert Capabilities().remote_memory_kinds == {"cpu"}
    gpu = Capabilities(memory_kinds=frozenset({"cpu", "cuda"}))
    assert gpu.remote_memory_kinds == {"cpu", "cuda"}
    split = Capabilities(memory_kinds=frozenset({"cpu", "cuda"}), remote_memory_kinds=frozenset({"cpu", "cuda"}))
    narrowed = dataclasses.replace(split, memory_kinds=frozenset({"cpu"}))
    assert (narrowed.memory_kinds, narrowed.remote_memory_kinds) == ({"cpu"}, {"cpu", "cuda"})
