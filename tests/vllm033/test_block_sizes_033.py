"""Different block sizes under vLLM 0.33's KV cache layouts (tensors planned and allocated
by vLLM 0.33's own code, strided per layout), read as the layout contract its GPU backends
follow: logical ``[blocks, heads, tokens, K|V]``, each token one row (vLLM's CPU backend,
which packs keys, is refused at the hand-shake instead).

Two loopback agents register one engine's caches with 16-token blocks and another's with
32-token blocks, in the layout the connector requests (``LBHNC``: heads outside tokens) and
in the tokens-outer one (``LBNHC``); the runs of :mod:`kvtransport_vllm.block_sizes` move
a prompt's tokens, and every token of every layer, K and V, is compared through the
cache's logical view (``[blocks, heads, block_size, K+V]`` here, whatever the physical
order): the token lands in the block and slot of its position, nothing else moves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtransport as kvt
from kvtransport_vllm.block_sizes import pair_by_token, run_segments
from kvtransport_vllm.kv_layout import HEADS_OUTER, TOKENS_OUTER, describe_kv_caches
from test_descriptors_033 import HEADS, NUM_BLOCKS, _caches  # the allocation vLLM 0.33 makes, per block size


def _register(agent, caches, block):
    """[(region, LayerMem)] as the worker describes and registers ``caches``."""
    return [(agent.register((lm.addr, lm.nbytes), kind=lm.kind, device=lm.device), lm)
            for lm in describe_kv_caches(caches, NUM_BLOCKS, HEADS, block)]


def _layouts(registered, region_of=lambda r: r):
    """(block layouts, attention layout) over the registered regions (a peer's: ``region_of``)."""
    out = [kvt.BlockLayout([(region_of(r), b) for b in lm.bases], lm.block_bytes, NUM_BLOCKS, lm.block_stride)
           for r, lm in registered]
    [kind] = {lm.attn_layout for _, lm in registered}
    return out, kind


@pytest.mark.parametrize("layout, kind", [("LBHNC", HEADS_OUTER), ("LBNHC", TOKENS_OUTER)])
@pytest.mark.parametrize("src_block, dst_block", [(16, 32), (32, 16)])
def test_tokens_land_at_their_position_across_block_sizes(layout, kind, src_block, dst_block):
    tokens = 150
    src, dst = _caches(layout, src_block), _caches(layout, dst_block)
    g = torch.Generator().manual_seed(src_block)
    for t in src.values():
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))
    rng = np.random.default_rng(dst_block)
    src_ids = rng.permutation(NUM_BLOCKS)[: -(-tokens // src_block)]
    dst_ids = rng.permutation(NUM_BLOCKS)[: -(-tokens // dst_block)]
    a, b = kvt.open("loopback", name="dst"), kvt.open("loopback", name="src")
    try:
        local, lkind = _layouts(_register(a, dst, dst_block))
        theirs = _register(b, src, src_block)
        peer = a.connect(b.metadata())
        remote, rkind = _layouts(theirs, lambda r: peer.region(r.id))
        assert lkind == rkind == kind
        runs = pair_by_token(dst_ids, dst_block, 0, src_ids, src_block, 0)
        ls = run_segments(local, runs.local_ids, runs.local_slot, runs.tokens, dst_block, HEADS, kind)
        rs = run_segments(remote, runs.remote_ids, runs.remote_slot, runs.tokens, src_block, HEADS, kind)
        assert a.read(peer, ls, rs, timeout=10).wait(timeout=10).ok
        pos = torch.arange(min(len(src_ids) * src_block, len(dst_ids) * dst_block))  # what both lists hold
        s_blk, d_blk = torch.as_tensor(src_ids)[pos // src_block], torch.as_tensor(dst_ids)[pos // dst_block]
        moved = torch.zeros(NUM_BLOCKS, dst_block, dtype=torch.bool)
        moved[d_blk, pos % dst_block] = True
        for name in src:  # vLLM's logical view [blocks, heads, block_size, K+V], as [blocks, slot, ...]
            s_view, d_view = src[name].transpose(1, 2), dst[name].transpose(1, 2)
            assert torch.equal(d_view[d_blk, pos % dst_block], s_view[s_blk, pos % src_block]), name
            assert not d_view[~moved].any(), name  # nothing but those tokens moved
    finally:
        a.close()
        b.close()
