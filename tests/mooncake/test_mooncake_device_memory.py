"""GPU memory on the mooncake backend: accepted where the loaded Transfer Engine is a CUDA
build, refused with the fix where it is not (this host's ``mooncake-transfer-engine-non-cuda``);
a peer's device memory is accepted either way (its own engine moves it).

The installed engine is the non-CUDA build, so the refusal runs for real; the decision for a
CUDA build runs with the engine's answer given as input (:mod:`kvtransport_mooncake.device`).
Device addresses point at nothing mapped: a CPU copy of one would crash the test.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport import metadata as md_mod
from kvtransport.spi import Op
from kvtransport.testing.required import skip_unless_usable

UNMAPPED = 0x10_0000  # 1 MiB: never mapped in a Linux process


@pytest.fixture
def agents():
    skip_unless_usable("mooncake")
    opened: list[kvt.Agent] = []

    def open_(name: str) -> kvt.Agent:
        a = kvt.open("mooncake", name=name)
        opened.append(a)
        return a

    yield open_
    for a in opened:
        a.close()


# -- the decision, with the engine's capability as input -----------------------------------
def test_cuda_support_is_what_the_engine_module_says():
    from kvtransport_mooncake import device as D

    assert D.supports_cuda(types.SimpleNamespace(SUPPORT_CUDA=True)) is True
    assert D.supports_cuda(types.SimpleNamespace(SUPPORT_CUDA=False)) is False
    assert D.supports_cuda(types.SimpleNamespace()) is None  # a build that does not say


@pytest.mark.parametrize("kind,device,cuda,where", [
    ("cpu", -1, False, "*"),
    ("cpu", -1, True, "*"),
    ("cuda", 2, True, "cuda:2"),  # a CUDA build registers the region on its GPU
    ("cuda", 0, False, None),     # the non-CUDA build: refused
    ("cuda", 0, None, None),      # a build that does not say: refused
])
def test_registration_location_for_each_build(kind, device, cuda, where):
    from kvtransport_mooncake import device as D

    assert D.location(kind, device, cuda) == where


def test_the_installed_engine_is_reported_as_what_its_package_is():
    """The flag read here agrees with the pip distribution that installed the engine."""
    skip_unless_usable("mooncake")
    from kvtransport_mooncake import device as D
    from kvtransport_mooncake.probe import load_engine_module

    cuda = D.supports_cuda(load_engine_module())
    dists = D.installed_distribution().split(", ")
    assert cuda is ("mooncake-transfer-engine" in dists), (cuda, dists)


# -- the refusal on this (non-CUDA) build ---------------------------------------------------
def test_non_cuda_build_refuses_gpu_memory_naming_the_fix(agents):
    from kvtransport_mooncake import device as D
    from kvtransport_mooncake.probe import load_engine_module

    if D.supports_cuda(load_engine_module()):
        pytest.skip("the installed Mooncake engine is a CUDA build: it registers GPU memory")
    a, b = agents("dev-a"), agents("dev-b")
    with pytest.raises(D.MooncakeMemoryKindUnavailable) as ei:
        a.register((UNMAPPED, 1 << 20), kind="cuda", device=0)
    err = ei.value
    msg = str(err)
    assert isinstance(err, errors.UnsupportedMemoryKindError) and err.kind == "cuda", msg
    assert "'mooncake' cannot register 'cuda' memory" in msg, msg
    assert "built without CUDA" in msg and "mooncake-transfer-engine-non-cuda" in msg, msg  # why
    assert "pip install 'mooncake-transfer-engine>=0.3.13'" in msg, msg  # the fix
    assert "mooncake" not in [x.split(" ")[0] for x in err.alternatives] and err.alternatives, msg
    assert a.regions == []

    # the refusal left the agent whole: host memory still registers and moves
    src = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    rs, rd = b.register(src), a.register(dst)
    peer = a.connect(b.metadata())
    assert a.read(peer, rd.whole(), peer.region(rs.id).whole()).wait(30).ok
    assert np.array_equal(dst, src)


# -- a peer's device memory -----------------------------------------------------------------
def test_cpu_engine_pairs_with_a_peer_exporting_gpu_memory(agents):
    """A peer's region exported as device memory (kind "cuda", as a CUDA-build peer exports
    its KV cache; mooncake regions carry no blob) is accepted at connect and by prepare()."""
    gpu_engine, cpu_host = agents("gpu-engine"), agents("cpu-host")
    exported = gpu_engine.register(np.ones(1 << 16, np.uint8))
    md = md_mod.decode_metadata(gpu_engine.metadata())
    fields = {f: getattr(md, f) for f in md.__struct_fields__}
    fields["regions"] = [md_mod.RegionDesc(r.id, r.addr, r.length, "cuda", r.blob) for r in md.regions]
    peer = cpu_host.connect(md_mod.encode_metadata(md_mod.AgentMetadata(**fields)))
    local = cpu_host.register(np.zeros(1 << 16, np.uint8))
    remote = peer.region(exported.id)
    assert remote.kind == "cuda"
    for op in (Op.READ, Op.WRITE):
        prepared = cpu_host.prepare(op, peer, local.segments([0], [8192]), remote.segments([4096], [8192]))
        assert prepared.nbytes == 8192
