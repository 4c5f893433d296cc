"""Issue 16 point 2: ucx and nixl tell their libraries what device memory is.

ucx maps ``cuda`` / ``rocm`` regions as ``UCS_MEMORY_TYPE_CUDA`` / ``_ROCM`` and posts every
put/get on them with that memory type; it refuses a kind the loaded UCX context cannot
move before ``ucp_mem_map`` sees the address. nixl registers ``cuda`` regions as VRAM on
their device and names the peer's device in its transfer descriptors.

No GPU here: the mapping is checked against FAKE libucp / FAKE NIXL agent objects that
record the calls (they test our glue, not UCX or NIXL), and the refusals against the real
libraries, in subprocesses where a CPU access to the unmapped "device" address would be a
SIGSEGV.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.process_identity import ProcessIdentity
from kvtransport.registry import available_backends
from kvtransport.spi import LocalRegion, RemoteRegion

UNMAPPED = 0x10_0000
ROOT = Path(__file__).resolve().parents[2]


def _usable(name: str) -> None:
    info = {i.name: i for i in available_backends()}.get(name)
    if info is None or not info.usable:
        pytest.skip(f"backend {name} is not usable here: {info and info.reason}")


# -- ucx ---------------------------------------------------------------------------------------
class FakeLibucp:
    """FAKE libucp: records ucp_mem_map parameters; its context 'moves' the given types."""

    def __init__(self, memory_types: int) -> None:
        self.memory_types = memory_types
        self.mapped: list[tuple[int, int, int, int]] = []  # (address, length, memory_type, field_mask)
        self._rkey = ctypes.create_string_buffer(b"fake-rkey")
        self.queries = 0

    def ucp_context_query(self, ctx, attr_ref) -> int:
        self.queries += 1
        attr_ref._obj.memory_types = self.memory_types
        return 0

    def ucp_mem_map(self, ctx, params_ref, memh_ref) -> int:
        p = params_ref._obj
        self.mapped.append((p.address, p.length, p.memory_type, p.field_mask))
        memh_ref._obj.value = 0x1000 + len(self.mapped)
        return 0

    def ucp_rkey_pack(self, ctx, memh, buf_ref, size_ref) -> int:
        buf_ref._obj.value = ctypes.addressof(self._rkey)
        size_ref._obj.value = len(self._rkey.value)
        return 0

    def ucp_rkey_buffer_release(self, buf) -> None:
        pass


class FakeWorker:
    def __init__(self, ucp: FakeLibucp) -> None:
        self.ucp, self.context, self.lock = ucp, ctypes.c_void_p(1), threading.RLock()


def _fake_local_memory(types: int, kinds_here: frozenset[str] = frozenset()):
    """``kinds_here``: the device kinds the (real) UCX would move here with its device
    transports selected; empty = a GPU-less host."""
    from kvtransport_ucx import memory as _memory, ucp as U

    U.lib()  # status strings for errors
    ucp = FakeLibucp(types)
    return _memory.LocalMemory(FakeWorker(ucp), kinds_here=lambda: kinds_here), ucp, U


def test_ucx_maps_each_kind_with_its_ucs_memory_type_fake_libucp():
    pytest.importorskip("kvtransport_ucx")
    from kvtransport_ucx.ucp import UCS_MEMORY_TYPE_CUDA, UCS_MEMORY_TYPE_HOST, UCS_MEMORY_TYPE_ROCM

    mem, ucp, U = _fake_local_memory((1 << UCS_MEMORY_TYPE_HOST) | (1 << UCS_MEMORY_TYPE_CUDA)
                                     | (1 << UCS_MEMORY_TYPE_ROCM))
    regions = [LocalRegion(1, 0x7000_0000, 4096, "cpu", -1), LocalRegion(2, UNMAPPED, 1 << 20, "cuda", 0),
               LocalRegion(3, UNMAPPED + (1 << 20), 1 << 20, "rocm", 1)]
    for r in regions:
        assert mem.register(r) == b"fake-rkey"
    assert [(a, n, t) for a, n, t, _ in ucp.mapped] == [
        (0x7000_0000, 4096, UCS_MEMORY_TYPE_HOST), (UNMAPPED, 1 << 20, UCS_MEMORY_TYPE_CUDA),
        (UNMAPPED + (1 << 20), 1 << 20, UCS_MEMORY_TYPE_ROCM)]
    assert all(m & U.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE for *_, m in ucp.mapped)
    # put/get parameters: device regions say their memory type, host ones leave it to UCX
    cpu, cuda, rocm = (mem.rparams[r.id] for r in regions)
    assert not cpu.op_attr_mask & U.UCP_OP_ATTR_FIELD_MEMORY_TYPE
    for rp, t in ((cuda, UCS_MEMORY_TYPE_CUDA), (rocm, UCS_MEMORY_TYPE_ROCM)):
        assert rp.op_attr_mask & U.UCP_OP_ATTR_FIELD_MEMORY_TYPE and rp.memory_type == t
        assert rp.op_attr_mask & U.UCP_OP_ATTR_FIELD_MEMH
    # the parameters the data path posts a segment of region 2 with are region 2's
    ref = next(iter(mem.local_params(np.array([2, 2], np.int64), None)))
    assert ctypes.addressof(ref._obj) == ctypes.addressof(cuda)
    assert ucp.queries == 1  # asked once, only for device memory


def test_ucx_refuses_a_kind_its_context_lacks_before_mapping_fake_libucp():
    pytest.importorskip("kvtransport_ucx")
    from kvtransport_ucx.memory import UcxMemoryKindUnavailable

    mem, ucp, _ = _fake_local_memory(1)  # host only: a UCX without CUDA / ROCm modules
    for kind in ("cuda", "rocm"):
        with pytest.raises(UcxMemoryKindUnavailable) as ei:
            mem.register(LocalRegion(5, UNMAPPED, 4096, kind, 0))
        assert isinstance(ei.value, errors.UnsupportedMemoryKindError)
        assert f"'ucx' cannot register {kind!r}" in str(ei.value) and "['host']" in str(ei.value)
    assert ucp.mapped == [] and mem.rparams == {}  # nothing reached ucp_mem_map


def test_ucx_refusal_names_the_transport_list_when_ucx_has_cuda_here_fake_libucp():
    """A context without CUDA on a host whose UCX moves CUDA (a GPU host, tls='tcp'): the
    refusal blames the transport list and names the fix, not the driver."""
    pytest.importorskip("kvtransport_ucx")
    from kvtransport_ucx.memory import UcxDeviceTransportsExcluded, UcxMemoryKindUnavailable

    mem, ucp, _ = _fake_local_memory(1, kinds_here=frozenset({"cuda"}))
    with pytest.raises(UcxDeviceTransportsExcluded) as ei:
        mem.register(LocalRegion(5, UNMAPPED, 4096, "cuda", 0))
    msg = str(ei.value)
    assert isinstance(ei.value, errors.UnsupportedMemoryKindError)
    assert "leaves them out" in msg and "device_memory='cuda'" in msg, msg
    assert "tls='tcp,cuda'" in msg and "UCX_TLS=tcp,cuda" in msg and "CUDA driver" not in msg, msg
    # rocm is not among the kinds this UCX moves here: that refusal is about the build
    with pytest.raises(UcxMemoryKindUnavailable) as ei:
        mem.register(LocalRegion(6, UNMAPPED, 4096, "rocm", 0))
    assert not isinstance(ei.value, UcxDeviceTransportsExcluded) and "--with-rocm" in str(ei.value)
    # a GPU-less host: the driver, not the list
    mem, ucp, _ = _fake_local_memory(1, kinds_here=frozenset())
    with pytest.raises(UcxMemoryKindUnavailable) as ei:
        mem.register(LocalRegion(5, UNMAPPED, 4096, "cuda", 0))
    assert not isinstance(ei.value, UcxDeviceTransportsExcluded)
    assert "CUDA driver" in str(ei.value) and "leaves them out" not in str(ei.value)
    assert ucp.mapped == []


def test_ucx_declares_device_kinds_and_the_real_context_here_refuses_them_with_reasons():
    """Subprocess: the real UCX of this GPU-less host, unmapped 'device' addresses. The
    refusal happens before any UCX or CPU access (else SIGSEGV, non-zero exit)."""
    _usable("ucx")
    code = textwrap.dedent(f"""
        import numpy as np, kvtransport as kvt
        from kvtransport import errors
        a = kvt.open("ucx")
        print(sorted(a.capabilities.memory_kinds))
        a.register(np.zeros(64, np.uint8))
        for kind in ("cuda", "rocm"):
            try:
                a.register(({UNMAPPED}, 1 << 20), kind=kind, device=0)
                print(kind, "ACCEPTED")
            except errors.UnsupportedMemoryKindError as e:
                print(kind, "refused|", e)
        print("regions", len(a.regions))
        a.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout}\n{out.stderr}"
    lines = out.stdout.splitlines()
    assert lines[0] == "['cpu', 'cuda', 'rocm']"
    if any(" ACCEPTED" in ln for ln in lines):
        pytest.skip("this host's UCX moves device memory: the refusal does not apply")
    cuda, rocm = lines[1], lines[2]
    assert cuda.startswith("cuda refused|") and "CUDA driver" in cuda and "kv_buffer_device" in cuda, cuda
    assert "nixl" in cuda and "moriio" in cuda, cuda  # installed backends that declare cuda
    assert rocm.startswith("rocm refused|") and "--with-rocm" in rocm and "moriio" in rocm, rocm
    assert lines[3] == "regions 1"


# -- nixl --------------------------------------------------------------------------------------
class FakeNixlAgent:
    """FAKE NIXL agent: records descriptor lists (tests our glue, not NIXL)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[list[int]], str]] = []

    def get_reg_descs(self, arr, kind):
        self.calls.append(("reg", np.asarray(arr).tolist(), kind))
        return ("reg", kind)

    def register_memory(self, descs):
        pass

    def deregister_memory(self, descs):
        pass

    def get_xfer_descs(self, arr, kind):
        self.calls.append(("xfer", np.asarray(arr).tolist(), kind))
        return ("xfer", kind)


def _nixl_with_fake_agent(monkeypatch):
    _usable("nixl")
    from kvtransport_nixl import backend as nb

    monkeypatch.setattr(nb.P, "has_gpu", lambda: True)  # as on a GPU host
    a = kvt.open("nixl")
    be = a._backend
    real_nx = be._nx
    fake = FakeNixlAgent()
    be._nx = be._data.nx = fake
    return a, be, fake, real_nx


def test_nixl_declares_cuda_only_where_a_gpu_and_vram_plugin_exist(monkeypatch):
    _usable("nixl")
    from kvtransport_nixl import backend as nb

    assert nb.NixlBackend.capabilities.memory_kinds == {"cpu", "cuda"}  # what NIXL can move
    with kvt.open("nixl") as a:  # no GPU here
        assert a.capabilities.memory_kinds == {"cpu"}
        with pytest.raises(errors.UnsupportedMemoryKindError, match="'nixl' cannot register 'cuda'"):
            a.register((UNMAPPED, 4096), kind="cuda", device=0)
    monkeypatch.setattr(nb.P, "has_gpu", lambda: True)
    with kvt.open("nixl") as a:  # NIXL's UCX plugin lists VRAM_SEG; with a GPU, cuda is offered
        assert a.capabilities.memory_kinds == {"cpu", "cuda"}


def test_nixl_cuda_regions_are_vram_on_their_device_fake_nixl_agent(monkeypatch):
    a, be, fake, real_nx = _nixl_with_fake_agent(monkeypatch)
    try:
        blob = be.register(LocalRegion(11, UNMAPPED, 1 << 20, "cuda", 3))
        cpu_blob = be.register(LocalRegion(12, 0x7000_0000, 4096, "cpu", -1))
        assert fake.calls == [("reg", [[UNMAPPED, 1 << 20, 3]], "VRAM"), ("reg", [[0x7000_0000, 4096, 0]], "DRAM")]
        assert cpu_blob == b"" and blob == (3).to_bytes(4, "little")  # the device travels to the peer
        # a peer's regions: device from the blob; descriptors of both sides name kind and device
        from kvtransport_nixl.peers import Conn
        from kvtransport_nixl.wire import CODEC

        exp = CODEC.seal(ProcessIdentity(1, 1, "b", "n"), nixl_name="peer@kvt-0", nixl_md=b"", plugins=["UCX"])
        conn = Conn("peer", exp, [RemoteRegion(7, UNMAPPED, 1 << 20, "cuda", (5).to_bytes(4, "little")),
                                  RemoteRegion(8, UNMAPPED, 1 << 20, "cuda", (6).to_bytes(4, "little"))])
        assert be._data.local_kind(np.array([11])) == ("VRAM", 3)
        assert be._data.remote_kind(conn, np.array([7, 7])) == ("VRAM", 5)
        with pytest.raises(errors.KVTransportError, match="one per side"):
            be._data.remote_kind(conn, np.array([7, 8]))  # two devices in one NIXL transfer
        fake.calls.clear()
        be._data.descs(np.array([UNMAPPED, UNMAPPED + 4096], np.uint64), np.array([4096, 4096], np.uint64), "VRAM", 5)
        assert fake.calls == [("xfer", [[UNMAPPED, 4096, 5], [UNMAPPED + 4096, 4096, 5]], "VRAM")]
    finally:
        be._data.regs.clear()
        be._nx = be._data.nx = real_nx
        a.close()


def test_nixl_refuses_a_peer_region_with_a_malformed_device_blob():
    _usable("nixl")
    from kvtransport_nixl.peers import Conn
    from kvtransport_nixl.wire import CODEC

    exp = CODEC.seal(ProcessIdentity(1, 1, "b", "n"), nixl_name="peer@kvt-0", nixl_md=b"", plugins=["UCX"])
    for blob in (b"", b"\x01\x02"):
        with pytest.raises(errors.PeerMetadataError, match="malformed blob"):
            Conn("peer", exp, [RemoteRegion(7, UNMAPPED, 4096, "cuda", blob)])
