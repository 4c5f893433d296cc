"""Issue 16 point 4 (acceptance 2): host staging (``kv_buffer_device: cpu``), on CPU tensors.

On a CPU engine staging is the degenerate case but still a real copy: the transport is
given a separate host mirror of the KV cache, so a load whose bytes were not copied from
the mirror into the cache (or a send whose blocks were not copied into the mirror) leaves
the wrong KV in the consumer's blocks, and the byte checks below fail. The device copy
itself (``.to(device)``, pinned memory, the stream synchronize) cannot run here.
"""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError  # noqa: E402
from kvtransport_vllm.kv_layout import describe_kv_caches  # noqa: E402
from kvtransport_vllm.staging import (  # noqa: E402
    DirectDeviceKV,
    HostFence,
    HostKV,
    HostStaging,
    KVDevice,
    make_kv_device,
)
from kvtransport_vllm.worker import KVTransportWorker  # noqa: E402

from . import recording_backend as rec  # noqa: E402
from kvtransport.testing.ports import free_port_range  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "vllm"))
os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")

NB = 8


def _vllm_cpu_layout() -> torch.Tensor:  # [num_blocks, kv_heads, block_size, 2*head_size]
    return torch.randn(NB, 2, 4, 16)


def _kv_split_layout() -> torch.Tensor:  # K/V halves first: [2, num_blocks, block_size, heads, dim]
    return torch.randn(2, NB, 4, 2, 8)


def _permuted_view() -> torch.Tensor:  # raw buffer in stride order, viewed permuted (as vLLM does)
    return torch.randn(NB, 2, 4, 2, 8).permute(1, 0, 3, 2, 4)


LAYOUTS = [_vllm_cpu_layout, _kv_split_layout, _permuted_view]


def _staging(make) -> tuple[HostStaging, list[torch.Tensor]]:
    caches = {f"layers.{i}": make() for i in range(3)}
    layers = describe_kv_caches(caches, NB)
    st = make_kv_device(layers, "cpu")
    assert isinstance(st, HostStaging)
    return st, list(caches.values())


def _blocks(t: torch.Tensor, dim: int, ids: list[int]) -> torch.Tensor:
    return t.index_select(dim, torch.tensor(ids))


@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__.strip("_"))
def test_before_send_copies_exactly_the_named_blocks_into_the_host_mirror(make):
    st, caches = _staging(make)
    for h in st.host:
        h.fill_(-1.0)
    ids, rest = [5, 0, 3], [1, 2, 4, 6, 7]
    st.before_send(ids)
    for lm, h, cache in zip(st.layers, st.host, caches):
        assert h.data_ptr() != cache.data_ptr()  # a separate buffer: a real copy, even on CPU
        assert h.shape == cache.shape and h.stride() == cache.stride()
        assert torch.equal(_blocks(h, lm.block_dim, ids), _blocks(cache, lm.block_dim, ids))
        assert bool((_blocks(h, lm.block_dim, rest) == -1.0).all())  # nothing else written


@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__.strip("_"))
def test_after_receive_copies_exactly_the_named_blocks_into_the_cache(make):
    st, caches = _staging(make)
    before = [c.clone() for c in caches]
    for h in st.host:
        h.copy_(torch.randn(h.shape))  # bytes "landed" by a transport in every mirror block
    ids, rest = [6, 1], [0, 2, 3, 4, 5, 7]
    st.after_receive(ids)
    for lm, h, cache, old in zip(st.layers, st.host, caches, before):
        d = lm.block_dim
        assert torch.equal(_blocks(cache, d, ids), _blocks(h, d, ids))
        assert torch.equal(_blocks(cache, d, rest), _blocks(old, d, rest))  # other blocks untouched


def test_empty_block_lists_copy_nothing():
    st, caches = _staging(_vllm_cpu_layout)
    before = [c.clone() for c in caches]
    for h in st.host:
        h.fill_(3.0)
    st.before_send([])
    st.after_receive([])
    assert all(bool((h == 3.0).all()) for h in st.host)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


def test_registered_layers_describe_the_mirror_with_the_caches_layout():
    st, caches = _staging(_kv_split_layout)
    cache_layers = st.layers
    reg = st.registered(cache_layers)
    for r, c, h in zip(reg, cache_layers, st.host):
        assert r.addr == h.data_ptr() != c.addr
        assert (r.kind, r.device) == ("cpu", -1)
        assert (r.nbytes, r.bases, r.block_bytes, r.block_stride, r.block_dim) == \
            (c.nbytes, c.bases, c.block_bytes, c.block_stride, c.block_dim)


def test_policy_table():
    cpu_layers = describe_kv_caches({"l": _vllm_cpu_layout()}, NB)
    assert type(make_kv_device(cpu_layers, "auto")) is HostKV
    assert type(make_kv_device(cpu_layers, "cpu")) is HostStaging
    from .test_memory_kinds import UNMAPPED, DeviceTensorLike
    dev_layers = describe_kv_caches({"l": DeviceTensorLike("cuda", 1, UNMAPPED, (NB, 4, 2, 8))}, NB)
    d = make_kv_device(dev_layers, "auto")
    assert type(d) is DirectDeviceKV and d.device.index == 1


# -- the worker registers the mirror ---------------------------------------------------------
def _worker(role: str, mode: str, buffer_device: str, backend: str = "loopback") -> KVTransportWorker:
    cfg = ConnectorConfig.from_extra(role, "staging-test", {"backend": backend, "mode": mode,
                                                            "side_channel_port": _free_port(),
                                                            "kv_buffer_device": buffer_device})
    return KVTransportWorker(cfg, 4, NB, "float32")


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: one from that range can be taken by
    any outgoing connection before the server binds it."""
    return free_port_range(1)


def test_staged_worker_registers_the_host_mirror_not_the_kv_cache(monkeypatch):
    rec.install(monkeypatch)
    caches = {f"layers.{i}": _vllm_cpu_layout() for i in range(2)}
    w = _worker("kv_consumer", "read", "cpu", backend=rec.NAME)
    w.register_kv_caches(caches)
    try:
        assert isinstance(w.kv_device, HostStaging)
        got = [r.addr for r in w.agent._backend.registered]
        assert got == [h.data_ptr() for h in w.kv_device.host]
        assert not set(got) & {t.data_ptr() for t in caches.values()}
    finally:
        w.shutdown()


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_staging_on_a_read_mode_producer_is_refused_naming_the_fix(role):
    w = _worker(role, "read", "cpu")
    with pytest.raises(ConnectorConfigError) as ei:
        w.register_kv_caches({"layers.0": _vllm_cpu_layout()})
    msg = str(ei.value)
    assert "kv_buffer_device" in msg and "mode 'write'" in msg and "'auto'" in msg, msg
    assert w.agent is None  # refused before any agent was opened


# -- end to end through real vLLM Schedulers, real loopback transfers -------------------------
STAGED = {"kv_buffer_device": "cpu"}


@pytest.fixture
def pairs():
    """tests/vllm's producer/consumer pairs (real Schedulers, loopback), closed at the end."""
    from harness import Pair

    made = []

    def make(*args, **kwargs):
        made.append(Pair(*args, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("mode,p_extra,c_extra", [
    ("write", STAGED, STAGED),  # both engines staged: WRITE moves mirror to mirror
    ("write", {}, STAGED),  # only the consumer staged
    ("write", STAGED, {}),  # only the producer staged
    ("read", {}, STAGED),  # READ: the consumer stages (producer staging is refused, above)
], ids=["write-both", "write-consumer", "write-producer", "read-consumer"])
def test_staged_loads_deliver_the_producers_bytes_into_the_consumers_kv_cache(pairs, mode, p_extra, c_extra):
    from harness import finish_reason, prompt_of

    pair = pairs(mode, p_extra=p_extra, c_extra=c_extra)
    for eng, extra in ((pair.P, p_extra), (pair.C, c_extra)):
        kv_dev = eng.worker._worker.kv_device
        assert isinstance(kv_dev, HostStaging) == bool(extra)
    for i, n in enumerate((70, 33, 48)):
        prompt = prompt_of(n, seed=i + 3)
        params = pair.prefill(f"p{i}", prompt)
        pair.C.add(f"c{i}", prompt, 2, params)
        seen = pair.run_to_end_checking_kv(f"c{i}", prompt)
        assert seen == [[]], f"c{i}: consumer KV differs from the producer's in blocks {seen}"
        assert finish_reason(pair.C, f"c{i}") == "length"
        assert pair.C.first_start[f"c{i}"] > 0  # really loaded, not recomputed from token 0
    pair.drain()
    pair.assert_no_leak()
    assert pair.C.worker._worker._staged_loads == {}  # every staged load copied or dropped


def test_only_successful_live_loads_are_copied_into_the_cache():
    """Failed loads are recomputed by vLLM; aborted requests' blocks may already belong to
    another request: neither is copied from the mirror into the cache."""
    w = _worker("kv_consumer", "read", "cpu")
    copied = []

    class Rec(KVDevice):
        def after_receive(self, ids, group_sizes=()):
            copied.append(sorted(ids))
            return HostFence(done=True)

    w.kv_device = Rec()
    w._staged_loads = {"ok": ([1, 2], []), "failed": ([3], []), "aborted": ([4], []), "later": ([5], [])}
    now = w._copy_staged_loads({"ok", "failed", "aborted"}, failed={"failed"}, finished_req_ids={"aborted"})
    assert copied == [[1, 2]]
    assert now == {"failed", "aborted"}  # nothing to copy: reported at once
    assert w._copies_done() == {"ok"}  # reported once its copy is done
    assert w._staged_loads == {"later": ([5], [])}  # still loading: copied when it is reported


def _cuda() -> bool:
    return torch.cuda.is_available() and not getattr(torch.version, "hip", None)


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
@pytest.mark.parametrize("make", LAYOUTS, ids=lambda f: f.__name__.strip("_"))
def test_device_copies_on_cuda(make):
    """On a CUDA host: the mirror is pinned, and both copies move exactly the named blocks
    between device memory and the mirror (the device side this machine cannot run)."""
    caches = {f"layers.{i}": make().cuda() for i in range(2)}  # .cuda() keeps a dense view's strides
    layers = describe_kv_caches(caches, NB)
    direct = make_kv_device(layers, "auto")
    assert isinstance(direct, DirectDeviceKV)
    direct.before_send([1])  # the real current-stream synchronize
    st = make_kv_device(layers, "cpu")
    assert all(h.is_pinned() for h in st.host)
    ids = [6, 2]
    st.before_send(ids)
    for lm, h, cache in zip(st.layers, st.host, caches.values()):
        assert torch.equal(_blocks(h, lm.block_dim, ids), _blocks(cache.cpu(), lm.block_dim, ids))
    before = [c.cpu() for c in caches.values()]
    for h in st.host:
        h.copy_(torch.randn(h.shape))
    fence = st.after_receive([1, 7])
    fence.synchronize()
    assert fence.query()
    for lm, h, cache, old in zip(st.layers, st.host, caches.values(), before):
        got = cache.cpu()
        assert torch.equal(_blocks(got, lm.block_dim, [1, 7]), _blocks(h, lm.block_dim, [1, 7]))
        assert torch.equal(_blocks(got, lm.block_dim, [0, 2, 3, 4, 5, 6]),
                           _blocks(old, lm.block_dim, [0, 2, 3, 4, 5, 6]))
    st.close()  # unpins the mirror
