"""Host staging on hybrid models: KV cache groups that alias one allocation.

Since vLLM 0.32 the model runner allocates the whole KV cache as one buffer and views it
per layer (``allocate_kv_cache``); the groups of a hybrid model (sliding window + full
attention) overlay each other, so a sliding-window layer and a full-attention layer
address the same bytes, and a block id belongs to one group at a time. The caches here
are allocated by vLLM's own code (``get_kv_cache_config_from_groups`` +
``allocate_kv_cache``) on CPU, which stands in for device memory: the staging logic is
the same, only the copies are host to host.

What a user checks: after a staged load every group's blocks hold exactly the
producer's bytes (a per-layer mirror copied back with every group's ids wrote rows the
transport never filled over the other group's blocks), and the host mirror costs the
device cache's distinct bytes once, not once per group.
"""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
import kvtransport as kvt  # noqa: E402
from vllm.config import CacheConfig, VllmConfig  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvtransport_vllm.connector import KVTransportConnector  # noqa: E402
from kvtransport_vllm.kv_groups import flatten  # noqa: E402
from kvtransport_vllm.kv_layout import block_segments, describe_kv_caches  # noqa: E402
from kvtransport_vllm.staging import HostStaging, make_kv_device  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "vllm"))
os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")

NB, BLOCK, HEADS, HEAD = 8, 4, 2, 8


def vllm_allocated(groups: list[KVCacheGroupSpec], num_blocks: int, block_size: int,
                   layout: str = "LBHNC") -> dict[str, torch.Tensor]:
    """The per-layer KV cache views exactly as vLLM's model runner allocates them (one
    buffer; a hybrid model's groups overlay each other), in CPU memory."""
    vc = VllmConfig(cache_config=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks))
    vc.cache_config.kv_cache_layout = layout  # what the engine core resolves before allocating
    cfg = get_kv_cache_config_from_groups(vc, groups, 1 << 30)
    assert cfg.num_blocks == num_blocks
    return allocate_kv_cache(cfg, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout())


def hybrid_groups(block_size: int = BLOCK, heads: int = HEADS, head: int = HEAD, window: int = 8,
                  sw_layers: tuple[str, ...] = ("l.0", "l.2"),
                  full_layers: tuple[str, ...] = ("l.1", "l.3")) -> list[KVCacheGroupSpec]:
    """Sliding-window group first, then full attention (vLLM's order for such a Llama)."""
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=torch.float32)
    sw = SlidingWindowSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=torch.float32,
                           sliding_window=window)
    return [KVCacheGroupSpec(list(sw_layers), sw), KVCacheGroupSpec(list(full_layers), full)]


def layer_groups(groups: list[KVCacheGroupSpec], names) -> list[int]:
    group_of = {n: g for g, spec in enumerate(groups) for n in spec.layer_names}
    return [group_of[n] for n in names]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _storages(ts) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_vllm_allocates_hybrid_groups_as_aliased_views(layout):
    """The premise, from vLLM's own allocation: one buffer, the groups' layers overlay."""
    kv = vllm_allocated(hybrid_groups(), NB, BLOCK, layout)
    assert len(_storages(kv.values())) == 1
    assert kv["l.0"].data_ptr() == kv["l.1"].data_ptr() and kv["l.2"].data_ptr() == kv["l.3"].data_ptr()


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_staged_load_leaves_every_groups_blocks_byte_exact(layout):
    """A real loopback READ into the registered host mirror, with the per-group block ids
    and per-layer groups the consumer uses (block_segments), then the copy into the cache."""
    groups = hybrid_groups()
    prod = vllm_allocated(groups, NB, BLOCK, layout)
    for t in prod.values():  # the producer's KV: random bytes everywhere (later views overwrite aliased ones)
        t.copy_(torch.randn(t.shape))
    cons = vllm_allocated(groups, NB, BLOCK, layout)  # zeros
    names = list(cons)
    lg = layer_groups(groups, names)
    # block ids as vLLM's one pool hands them out: unique across groups on each engine
    p_ids, c_ids = [[6, 7], [1, 2, 3, 4]], [[5, 1], [2, 3, 6, 7]]
    untouched = [0, 4]
    p_flat, sizes = flatten(p_ids)
    c_flat, _ = flatten(c_ids)

    c_layers = describe_kv_caches(cons, NB)
    st = make_kv_device(c_layers, "cpu", lg)
    assert isinstance(st, HostStaging)
    with kvt.open("loopback", name="staging-p") as pa, kvt.open("loopback", name="staging-c") as ca:
        p_lay, c_lay = [], []
        for lm in describe_kv_caches(prod, NB):
            r = pa.register((lm.addr, lm.nbytes), kind="cpu")
            p_lay.append((r.id, lm))
        for lm in st.registered(c_layers):
            r = ca.register((lm.addr, lm.nbytes), kind="cpu")
            c_lay.append(kvt.BlockLayout([(r, b) for b in lm.bases], lm.block_bytes, NB, lm.block_stride))
        peer = ca.connect(pa.metadata())
        r_lay = [kvt.BlockLayout([(peer.region(rid), b) for b in lm.bases], lm.block_bytes, NB, lm.block_stride)
                 for rid, lm in p_lay]
        t = ca.read(peer, block_segments(c_lay, c_flat, sizes, lg), block_segments(r_lay, p_flat, sizes, lg))
        assert t.wait(10).ok, t.status()
    fence = st.after_receive(c_flat, sizes)
    assert fence.query()  # a CPU cache: copied synchronously

    for name, g in zip(names, lg):
        c, p = cons[name], prod[name]
        got = _bytes(c.index_select(0, torch.tensor(c_ids[g])))
        want = _bytes(p.index_select(0, torch.tensor(p_ids[g])))
        assert torch.equal(got, want), f"layer {name} (group {g}): blocks {c_ids[g]} differ from the producer's"
        assert not _bytes(c.index_select(0, torch.tensor(untouched))).any(), f"layer {name}: unloaded blocks written"

    # the mirror: one host copy of each distinct device byte range, not one per layer
    dev, host = _storages(cons.values()), _storages(st.host)
    assert len(host) == len(dev) == 1
    assert sum(host.values()) == sum(dev.values())
    assert st.host[names.index("l.0")].data_ptr() == st.host[names.index("l.1")].data_ptr()  # aliased as on the device


def test_layers_of_separate_allocations_keep_separate_mirrors():
    """Without aliasing (one tensor per layer, as older vLLM and the CPU harness allocate)
    the mirror is one range per tensor, never merged across allocations."""
    caches = {f"layers.{i}": torch.randn(NB, HEADS, BLOCK, 2 * HEAD) for i in range(3)}
    st = make_kv_device(describe_kv_caches(caches, NB), "cpu")
    assert len(st.mirror.ranges) == 3
    assert st.mirror.mirrored_bytes == sum(t.numel() * 4 for t in caches.values())
    assert len({h.data_ptr() for h in st.host}) == 3


class VllmAllocatedKVConnector(KVTransportConnector):
    """KVTransportConnector handed its KV caches the way vLLM's model runner allocates
    them: one buffer, the hybrid groups overlaid. The engine's dict is refilled with those
    views, so the harness's stand-in forward writes, and its KV check reads, the memory
    the connector registered."""

    def register_kv_caches(self, kv_caches):
        groups = self._kv_cache_config.kv_cache_groups
        first = next(iter(kv_caches.values()))
        views = vllm_allocated(groups, first.shape[0], first.shape[2])
        assert list(views) == list(kv_caches) and views["layers.0"].shape == first.shape
        kv_caches.clear()
        kv_caches.update(views)
        super().register_kv_caches(kv_caches)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_hybrid_staged_consumer_loads_exact_kv_through_real_schedulers(mode):
    """Real vLLM Schedulers and workers, loopback transfers, the consumer staged with
    vLLM-allocated aliased caches: every full-attention block and every in-window
    sliding-window block equals the producer's, and no block leaked."""
    from harness import Pair, finish_reason, prompt_of

    pair = Pair(mode, c_extra={"kv_buffer_device": "cpu"}, consumer_cls=VllmAllocatedKVConnector,
                sliding_window=32)
    try:
        w = pair.C.worker._worker
        assert isinstance(w.kv_device, HostStaging)
        caches = list(pair.C.kv_caches.values())
        assert caches[0].data_ptr() == caches[1].data_ptr()  # the two groups' layers alias
        for i, n in enumerate((150, 70)):
            prompt = prompt_of(n, seed=40 + i)
            params = pair.prefill(f"p{i}", prompt)
            pair.C.add(f"c{i}", prompt, 2, params)
            seen = pair.run_to_end_checking_kv(f"c{i}", prompt)
            assert seen == [[]], f"c{i}: consumer KV differs from the producer's in blocks {seen}"
            assert finish_reason(pair.C, f"c{i}") == "length"
            assert pair.C.first_start[f"c{i}"] > 0  # loaded, not recomputed
        pair.drain()
        pair.assert_no_leak()
        assert w._staged_loads == {} and w._copying == []
        assert len({h.data_ptr() for h in w.kv_device.host}) == 1  # one mirror for the aliased layers
    finally:
        pair.close()
