"""Issue 16 points 1-2 on a machine without a GPU: memory kinds reach the backend intact,
backends refuse what they cannot move (naming the ones that can), and device memory never
reaches a CPU data path.

No CUDA tensor can exist here, so device memory is described by small objects exposing what
torch tensors expose (``.device.type/.index``, ``data_ptr()``, shape, strides) and by raw
``(address, length)`` pairs with ``kind="cuda"``. Their addresses point at nothing: any CPU
copy of them would crash, which is why the no-fast-path test runs in a subprocess.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import kvtransport as kvt
from kvtransport import errors, metadata as md_mod
from kvtransport.memory import tensor_memory_kind
from kvtransport.registry import available_backends, load_backend_class
from kvtransport.testing.ports import free_port_range

from . import recording_backend as rec

torch = pytest.importorskip("torch")
from kvtransport_vllm.config import ConnectorConfig  # noqa: E402
from kvtransport_vllm.kv_layout import describe_kv_caches  # noqa: E402
from kvtransport_vllm.worker import KVTransportWorker  # noqa: E402

# Declared memory kinds of every shipped backend class (issue 16, point 2): what each can move
# on a suitable host. An agent may narrow it to what this host offers (nixl without a GPU:
# cpu only), or refuse with the reason at register (ucx whose UCX lacks CUDA / ROCm
# transports, mooncake whose engine is not a CUDA build): tests/gpu/test_device_memory_types.py,
# tests/mooncake/test_mooncake_device_memory.py.
EXPECTED_KINDS = {
    "loopback": {"cpu"},
    "ucx": {"cpu", "cuda", "rocm"},
    "nixl": {"cpu", "cuda"},
    "mooncake": {"cpu", "cuda"},
    "moriio": {"cpu", "cuda", "rocm"},
}
# What a peer may export to each (tests/core/test_memory_capabilities.py): loopback copies both
# sides on the CPU; the others reach a peer's memory through the peer's own registration.
EXPECTED_REMOTE_KINDS = {
    "loopback": {"cpu"},
    "ucx": {"cpu", "cuda", "rocm"},
    "nixl": {"cpu", "cuda"},
    "mooncake": {"cpu", "cuda"},
    "moriio": {"cpu", "cuda", "rocm"},
}
NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 8, 4, 2, 16
UNMAPPED = 0x10_0000  # 1 MiB: never mapped in a Linux process, so a CPU copy would crash


@dataclass
class _Dev:
    type: str
    index: int | None


class DeviceTensorLike:
    """What the connector reads from a GPU KV tensor, without a GPU."""

    def __init__(self, kind: str, index: int, addr: int, shape: tuple[int, ...]):
        self.device = _Dev(kind, index)
        self.shape = shape
        self._addr = addr
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        self._strides = tuple(reversed(strides))

    def data_ptr(self) -> int:
        return self._addr

    def element_size(self) -> int:
        return 2

    def stride(self) -> tuple[int, ...]:
        return self._strides


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: one from that range can be taken by
    any outgoing connection before the server binds it."""
    return free_port_range(1)


def _worker(backend: str, monkeypatch) -> KVTransportWorker:
    monkeypatch.setenv("KVTRANSPORT_SECRET", "0123456789abcdef0123456789abcdef")
    cfg = ConnectorConfig.from_extra("kv_producer", "gpu-test",
                                     {"backend": backend, "side_channel_port": _free_port()})
    return KVTransportWorker(cfg, BLOCK_SIZE, NUM_BLOCKS, "float16")


# -- point 1: tensor -> (kind, device) ------------------------------------------------------
def test_tensor_memory_kind_maps_cpu_cuda_and_rocm(monkeypatch):
    assert tensor_memory_kind(torch.zeros(4)) == ("cpu", -1)
    assert tensor_memory_kind(DeviceTensorLike("cuda", 3, UNMAPPED, (4,))) == ("cuda", 3)
    assert tensor_memory_kind(DeviceTensorLike("cuda", None, UNMAPPED, (4,))) == ("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)  # a ROCm build of torch
    assert tensor_memory_kind(DeviceTensorLike("cuda", 1, UNMAPPED, (4,))) == ("rocm", 1)


def test_layouts_describe_device_tensors_like_cpu_ones():
    shape = (NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    cpu = describe_kv_caches({"l0": torch.zeros(shape, dtype=torch.float16)}, NUM_BLOCKS)[0]
    dev = describe_kv_caches({"l0": DeviceTensorLike("cuda", 2, UNMAPPED, shape)}, NUM_BLOCKS)[0]
    assert (cpu.kind, cpu.device) == ("cpu", -1)
    assert (dev.kind, dev.device, dev.addr) == ("cuda", 2, UNMAPPED)
    assert (dev.nbytes, dev.bases, dev.block_bytes, dev.block_stride) == \
        (cpu.nbytes, cpu.bases, cpu.block_bytes, cpu.block_stride)


# -- point 1: the connector passes each KV tensor's kind and device to the backend ----------
@pytest.mark.parametrize("kind,index", [("cpu", None), ("cuda", 1)])
def test_connector_registers_each_kv_tensor_with_its_kind_and_device(monkeypatch, kind, index):
    rec.install(monkeypatch)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)  # K/V split: two parts per layer
    if kind == "cpu":
        caches = {f"layer{i}": torch.zeros(shape, dtype=torch.float16) for i in range(3)}
    else:
        caches = {f"layer{i}": DeviceTensorLike("cuda", index, UNMAPPED + i * (1 << 20), shape)
                  for i in range(3)}
    w = _worker(rec.NAME, monkeypatch)
    w.register_kv_caches(caches)
    try:
        got = w.agent._backend.registered
        want_dev = -1 if kind == "cpu" else index
        assert [(r.addr, r.kind, r.device) for r in got] == \
            [(t.data_ptr(), kind, want_dev) for t in caches.values()]
        nbytes = 2 * NUM_BLOCKS * BLOCK_SIZE * HEADS * DIM * 2
        assert all(r.length == nbytes for r in got)
    finally:
        w.shutdown()


def test_connector_on_a_cpu_only_backend_refuses_gpu_caches_naming_alternatives(monkeypatch):
    caches = {"layer0": DeviceTensorLike("cuda", 0, UNMAPPED, (NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM))}
    w = _worker("loopback", monkeypatch)
    with pytest.raises(errors.UnsupportedMemoryKindError) as ei:
        w.register_kv_caches(caches)
    msg = str(ei.value)
    assert "'loopback'" in msg and "'cuda'" in msg and "moriio" in msg, msg
    assert ei.value.kind == "cuda" and any(a.startswith("moriio") for a in ei.value.alternatives)
    assert isinstance(ei.value, errors.InvalidSegmentsError)  # existing except clauses still match
    assert w.agent is None and w.ctx.local_layouts == []  # the refused worker left no agent open


# -- point 2: each backend's accept/refuse table ---------------------------------------------
def test_declared_memory_kinds_of_every_shipped_backend():
    declared = {n: set(load_backend_class(n).capabilities.memory_kinds) for n in EXPECTED_KINDS}
    assert declared == EXPECTED_KINDS
    remote = {n: set(load_backend_class(n).capabilities.remote_memory_kinds) for n in EXPECTED_REMOTE_KINDS}
    assert remote == EXPECTED_REMOTE_KINDS


@pytest.mark.parametrize("name", ["loopback", "ucx", "nixl", "mooncake"])
def test_backend_accepts_cpu_and_refuses_device_kinds_naming_alternatives(name):
    usable = {i.name: i for i in available_backends()}
    if not usable.get(name) or not usable[name].usable:
        pytest.skip(f"backend {name} is not usable here: {usable.get(name) and usable[name].reason}")
    a = kvt.open(name)
    try:
        buf = np.zeros(4096, np.uint8)
        assert a.register(buf).kind == "cpu"
        for kind in ("cuda", "rocm"):
            with pytest.raises(errors.UnsupportedMemoryKindError) as ei:
                a.register((UNMAPPED, 4096), kind=kind, device=0)
            msg = str(ei.value)
            assert f"{name!r} cannot register {kind!r} memory" in msg, msg
            assert "moriio" in msg and ei.value.alternatives, msg  # moriio declares cuda and rocm
            assert name not in [x.split(" ")[0] for x in ei.value.alternatives]
        assert len(a.regions) == 1  # nothing half-registered
    finally:
        a.close()


def test_no_installed_backend_for_a_kind_says_so():
    a = kvt.open("loopback")
    try:
        with pytest.raises(errors.UnsupportedMemoryKindError, match="no installed backend declares 'xpu'"):
            a.register((UNMAPPED, 4096), kind="xpu", device=0)
    finally:
        a.close()


# -- point 2: no CPU fast path is reachable for device memory --------------------------------
def test_cpu_only_backend_refuses_a_peer_exporting_device_memory():
    """A forged or mismatched peer claiming a cuda region is refused at connect, so the
    loopback memmove / process_vm_* copy can never be aimed at it."""
    src, dst = kvt.open("loopback"), kvt.open("loopback")
    try:
        src.register(np.zeros(4096, np.uint8))
        md = md_mod.decode_metadata(src.metadata())
        forged = md_mod.encode_metadata(md_mod.AgentMetadata(
            **{**{f: getattr(md, f) for f in md.__struct_fields__},
               "regions": [md_mod.RegionDesc(r.id, r.addr, r.length, "cuda", r.blob) for r in md.regions]}))
        with pytest.raises(errors.UnsupportedMemoryKindError, match="'cuda'"):
            dst.connect(forged)
        assert dst.peers == {}
    finally:
        src.close()
        dst.close()


def test_device_regions_reach_the_backend_untouched_by_the_core():
    """Two agents on a cuda-accepting recording backend move unmapped "cuda" regions READ
    and WRITE. The core validates, merges and posts them; if it copied, viewed or verified
    those bytes on the CPU the subprocess would die of SIGSEGV."""
    here = Path(__file__).resolve()
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(here.parents[2])!r})
        import pytest
        import kvtransport as kvt
        from tests.gpu import recording_backend as rec
        mp = pytest.MonkeyPatch()
        rec.install(mp)
        a, b = kvt.open(rec.NAME, name="a"), kvt.open(rec.NAME, name="b")
        ra = a.register(({UNMAPPED}, 1 << 20), kind="cuda", device=0)
        rb = b.register(({UNMAPPED} + (4 << 20), 1 << 20), kind="cuda", device=1)
        peer = b.connect(a.metadata())
        remote = peer.regions[0]
        for op in (b.read, b.write):
            t = op(peer, rb.segments([0, 8192], [4096, 4096]), remote.segments([4096, 0], [4096, 4096]))
            print(op.__name__, t.wait().state.name)
        be = b._backend
        print("kinds", sorted({{(r.kind, r.device) for r in be.registered}}),
              sorted({{r.kind for r in be.connected}}))
        print("addrs", [int(x) for x in be.posted[0].local_addr], [int(x) for x in be.posted[0].remote_addr])
        a.close(); b.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout}\n{out.stderr}"
    lines = out.stdout.splitlines()
    assert lines[:2] == ["read DONE", "write DONE"], out.stdout
    assert lines[2] == "kinds [('cuda', 1)] ['cuda']", out.stdout
    base_b = UNMAPPED + (4 << 20)
    assert lines[3] == f"addrs {[base_b, base_b + 8192]} {[UNMAPPED + 4096, UNMAPPED]}", out.stdout
