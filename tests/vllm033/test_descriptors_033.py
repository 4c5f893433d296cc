"""Byte ranges per load under vLLM 0.33's layouts, counted where they reach a backend.

Two loopback agents register KV caches that vLLM 0.33's planner and allocator lay out
(8 layers, FlashAttention shapes), described by our kv_layout exactly as the worker
registers them; a load of scattered blocks (no two consecutive, the worst case for
merging) is prepared by the core, which merges contiguous ranges, and the prepared
transfer's segment count is what the backend's post receives. Per-layer layouts need one
range per block and layer; cross-layer blocks one per block. The bytes moved are checked
too.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.worker.utils import allocate_kv_cache

import kvtransport as kvt
from kvtransport_vllm.kv_layout import HEADS_OUTER, block_segments, describe_kv_caches

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 8, 2, 16, 16, 40


def _caches(layout: str, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """One engine's per-layer KV caches as vLLM 0.33 allocates them under ``layout``
    (``block`` tokens a block)."""
    cfg = VllmConfig(cache_config=CacheConfig(block_size=block), device_config=DeviceConfig("cpu"))
    record_kv_cache_layout(cfg.cache_config, layout)
    cfg.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=block, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
    groups = [KVCacheGroupSpec([f"layers.{i}" for i in range(LAYERS)], spec)]
    kcc = get_kv_cache_config_from_groups(cfg, groups, available_memory=spec.page_size_bytes * LAYERS * NUM_BLOCKS)
    return allocate_kv_cache(kcc, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout(), [block])


def _register(agent, caches, peer=None):
    """Our layouts over ``caches`` as the worker builds them (regions of ``agent``; with
    ``peer``, the same regions as ``peer`` sees them)."""
    out = []
    for lm in describe_kv_caches(caches, NUM_BLOCKS, HEADS, BLOCK):
        assert lm.attn_layout == HEADS_OUTER
        region = agent.register((lm.addr, lm.nbytes), kind=lm.kind, device=lm.device)
        out.append((region, lm))
    return out


@pytest.mark.parametrize("layout, per_block", [("LBHNC", LAYERS), ("BLHNC", 1)])
def test_descriptors_per_load(layout, per_block):
    src, dst = _caches(layout), _caches(layout)
    g = torch.Generator().manual_seed(1)
    for t in src.values():
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))
    a, b = kvt.open("loopback", name="dst"), kvt.open("loopback", name="src")
    try:
        mine, theirs = _register(a, dst), _register(b, src)
        peer = a.connect(b.metadata())
        local = [kvt.BlockLayout([(r, x) for x in lm.bases], lm.block_bytes, NUM_BLOCKS, lm.block_stride)
                 for r, lm in mine]
        remote = [kvt.BlockLayout([(peer.region(r.id), x) for x in lm.bases], lm.block_bytes, NUM_BLOCKS,
                                  lm.block_stride) for r, lm in theirs]
        ids = list(range(1, 2 * 12, 2))  # 12 blocks, none next to another
        prepared = a.prepare(kvt.Op.READ, peer, block_segments(local, ids), block_segments(remote, ids))
        assert prepared.nsegments == per_block * len(ids)
        assert a.post(prepared).wait(timeout=10).ok
        for name in src:
            assert torch.equal(dst[name][ids], src[name][ids]), name
            others = [i for i in range(NUM_BLOCKS) if i not in ids]
            assert not dst[name][others].any(), name  # nothing but the asked blocks moved
    finally:
        a.close()
        b.close()


def test_cross_layer_with_two_kv_cache_groups_refused_naming_the_setting():
    """A hybrid model (full + sliding-window groups) on cross-layer blocks: vLLM overlays
    the groups' pages in each block (both groups' first layers at one offset), which no
    per-layer byte range describes; registration refuses it, naming kv_cache_layout."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kvtransport_vllm.kv_layout import KVLayoutError

    cfg = VllmConfig(cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig("cpu"))
    record_kv_cache_layout(cfg.cache_config, "BLHNC")
    cfg.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16,
                               sliding_window=32)
    groups = [KVCacheGroupSpec(["layers.0", "layers.2"], full), KVCacheGroupSpec(["layers.1", "layers.3"], window)]
    kcc = get_kv_cache_config_from_groups(cfg, groups, available_memory=full.page_size_bytes * 4 * NUM_BLOCKS)
    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    caches = allocate_kv_cache(kcc, torch.device("cpu"), layout, [BLOCK, BLOCK])
    assert caches["layers.0"].data_ptr() == caches["layers.1"].data_ptr()  # the groups overlay
    with pytest.raises(KVLayoutError, match="cross-layer layout with several KV cache groups.*kv_cache_layout"):
        describe_kv_caches(caches, NUM_BLOCKS, HEADS, BLOCK)
