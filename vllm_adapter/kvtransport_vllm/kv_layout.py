"""How a worker's paged KV cache tensors are described as kvtransport block layouts.

vLLM hands the connector one tensor per attention layer; the transport moves byte ranges.
This module turns each tensor into parts (one, or two for a K/V split) of ``num_blocks``
equally strided blocks, both for our own tensors (:func:`describe_kv_caches`,
:func:`local_layouts`) and for a peer's, from the :class:`~.messages.LayoutInfo` it sent
in the hand-shake (:func:`remote_layouts`). Anything that is not one dense byte range per
block is refused with a message instead of guessed.

vLLM's cross-layer layouts (``BLHNC`` / ``BLNHC``: each block holds the pages of every
layer, one after another) are described as ONE layout whose parts are the layers, all in
one region and interleaved inside each block (:func:`describe_kv_caches`); their
segments are built block by block (:func:`block_segments`), so the core merges a block's
layers, and runs of consecutive blocks, into one byte range each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import kvtransport as kvt
from kvtransport.memory import tensor_memory_kind

if TYPE_CHECKING:  # .messages imports vLLM; this module (and .staging) must import without it
    from .messages import LayoutInfo

__all__ = ["KVLayoutError", "LayerMem", "describe_kv_caches", "check_uniform", "remote_layouts", "block_segments",
           "head_slice", "piece_layouts", "interleaved", "HEADS_OUTER", "TOKENS_OUTER", "KV_OUTER", "AMBIGUOUS"]

#: inside a block, each head's tokens are one byte range (vLLM's CPU layout
#: ``[num_blocks, kv_heads, block_size, 2*head_size]``; head-major "HND" GPU blocks): a head range
#: of a block is one byte range too, so heterogeneous TP slices it without copying
HEADS_OUTER = "heads-outer"
#: inside a block, each token holds all heads (FlashAttention's
#: ``[2, num_blocks, block_size, kv_heads, head_size]``, "NHD"): a head range is scattered
#: over every token, so it cannot be moved as one range per block
TOKENS_OUTER = "tokens-outer"
#: K and V halves inside each block, heads inside them (e.g. a head-major layout
#: ``[num_blocks, 2, kv_heads, block_size, head_size]`` by stride): a head range is two
#: byte ranges per block; not sliced (refused across TP sizes)
KV_OUTER = "kv-outer"
#: the sizes cannot tell heads from tokens (block_size equals the rank's KV head count)
#: or from the K/V pair (2 heads per rank next to a K/V dimension): not sliced
AMBIGUOUS = "ambiguous"


class KVLayoutError(ValueError):
    """The KV cache tensors cannot be described as paged blocks, or the peer's differ."""


@dataclass
class LayerMem:
    """One layer's KV cache tensor as memory: where it is and how its blocks are laid out."""

    tensor: Any
    addr: int
    nbytes: int
    #: byte offset of each part: 1 (blocks first), 2 (K/V halves first) or, for vLLM's
    #: cross-layer layout, one per layer inside each block (interleaved, see interleaved())
    bases: list[int]
    block_bytes: int
    block_stride: int
    kind: str = "cpu"  # memory kind the agent registers it as: "cpu", "cuda" or "rocm"
    device: int = -1  # device index for device memory, -1 for CPU memory
    block_dim: int = 0  # the tensor dimension that indexes blocks (host staging copies along it)
    attn_layout: str = ""  # HEADS_OUTER, TOKENS_OUTER, KV_OUTER, AMBIGUOUS, "other", "" (heads not given)


def describe_kv_caches(kv_caches: dict[str, Any], num_blocks: int, kv_heads: int = 0,
                       block_size: int = 0) -> list[LayerMem]:
    """Describe each layer's paged cache as parts of ``num_blocks`` blocks.

    Works from sizes and strides, so permuted views (vLLM allocates a raw buffer and
    views it in the attention backend's stride order) are handled. The block dimension
    is the outermost dimension of size ``num_blocks``; a dimension of size 2 with a larger
    stride is a K/V split (two parts). Within a part, one block must be one dense byte
    range; anything else is refused with a message instead of guessing. With this rank's
    ``kv_heads`` and ``block_size`` given, each layer also says where heads lie inside a
    block (``attn_layout``), which decides whether a head range can be moved alone.
    """
    cross = _cross_layer(kv_caches, num_blocks, kv_heads, block_size)
    if cross is not None:
        return [cross]
    out = []
    for name, t in kv_caches.items():
        item = t.element_size()
        sizes, strides = list(t.shape), list(t.stride())
        cands = [d for d, n in enumerate(sizes) if n == num_blocks]
        if not cands:
            raise KVLayoutError(f"KV cache of layer {name} has shape {tuple(sizes)}: no dimension of "
                                f"num_blocks={num_blocks}")
        bd = max(cands, key=lambda d: strides[d])
        split = [d for d, n in enumerate(sizes) if n == 2 and strides[d] > strides[bd] and d != bd]
        inner = [d for d in range(len(sizes)) if d != bd and d not in split[:1]]
        if any(strides[d] > strides[bd] for d in inner):
            raise KVLayoutError(f"KV cache of layer {name} (shape {tuple(sizes)}, strides {tuple(strides)}) "
                                "does not keep each block in one byte range")
        per_block = 1
        for d in inner:
            per_block *= sizes[d]
        if per_block < strides[bd] and _dense([sizes[d] for d in inner], [strides[d] for d in inner]):
            raise KVLayoutError(
                f"KV cache of layer {name} (shape {tuple(sizes)}, strides {tuple(strides)}) interleaves its blocks "
                "with other memory (vLLM's cross-layer layout with several KV cache groups, or padded pages): not "
                "supported; use the heads-outer layout (kv_connector_extra_config kv_cache_layout: heads_outer, "
                "and no VLLM_KV_CACHE_LAYOUT)")
        if per_block != strides[bd]:
            raise KVLayoutError(f"KV cache of layer {name} (shape {tuple(sizes)}, strides {tuple(strides)}) "
                                "has gaps inside a block")
        bases = [0] if not split else [0, strides[split[0]] * item]
        span = 1 + sum((n - 1) * st for n, st in zip(sizes, strides))
        kind, device = tensor_memory_kind(t)  # a GPU cache is registered as GPU memory
        order = sorted(inner, key=lambda d: -strides[d])  # inner dimensions, outermost first
        out.append(LayerMem(t, int(t.data_ptr()), span * item, bases, per_block * item, strides[bd] * item,
                            kind, device, bd, _attn_layout([sizes[d] for d in order], kv_heads, block_size)))
    return out


def _dense(sizes: list[int], strides: list[int]) -> bool:
    """Whether dimensions of these sizes and strides cover one gap-free range (any order)."""
    want = 1
    for n, st in sorted(zip(sizes, strides), key=lambda x: x[1]):
        if n > 1 and st != want:
            return False
        want *= n if n > 1 else 1
    return True


def _cross_layer(kv_caches: dict[str, Any], num_blocks: int, kv_heads: int, block_size: int) -> LayerMem | None:
    """vLLM's cross-layer layout as one LayerMem, or None when the caches are not that.

    Cross-layer: every layer is a view of one allocation with the same shape, strides and
    dtype; its block dimension strides over the pages of all layers, its page is one dense
    range, and the layers' pages lie side by side inside each block (offsets ``0, P, 2P,
    ..``, no layer twice: several KV cache groups aliasing one block are not this). The
    result has one part per layer, in the order vLLM gave the layers (the order peers pair
    them in), one region over every layer's bytes, and ``tensor`` a ``[num_blocks, L*P]``
    view of those bytes (host staging copies whole blocks of it)."""
    ts = list(kv_caches.values())
    if len(ts) < 2:
        return None
    t0 = ts[0]
    sizes, strides, item = list(t0.shape), list(t0.stride()), t0.element_size()
    if any(list(t.shape) != sizes or list(t.stride()) != strides or t.element_size() != item for t in ts[1:]):
        return None
    cands = [d for d, n in enumerate(sizes) if n == num_blocks]
    if not cands:
        return None
    bd = max(cands, key=lambda d: strides[d])
    inner = [d for d in range(len(sizes)) if d != bd]
    if any(strides[d] >= strides[bd] and sizes[d] > 1 for d in inner):
        return None  # a K/V split (or another dimension) outside the blocks: not cross-layer
    if not _dense([sizes[d] for d in inner], [strides[d] for d in inner]):
        return None
    page = item
    for d in inner:
        page *= sizes[d]
    addrs = [int(t.data_ptr()) for t in ts]
    base = min(addrs)
    offsets = [a - base for a in addrs]
    stride = strides[bd] * item
    if sorted(offsets) != [i * page for i in range(len(ts))] or stride < len(ts) * page:
        return None
    if any(t.dtype != t0.dtype or t.device != t0.device
           or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() for t in ts[1:]):
        return None  # side by side by chance, not one allocation
    first = ts[addrs.index(base)]
    used = len(ts) * page
    view = first.as_strided((num_blocks, used // item), (strides[bd], 1), first.storage_offset())
    kind, device = tensor_memory_kind(first)
    order = sorted(inner, key=lambda d: -strides[d])
    return LayerMem(view, base, (num_blocks - 1) * stride + used, offsets, page, stride, kind, device, 0,
                    _attn_layout([sizes[d] for d in order], kv_heads, block_size))


def interleaved(lay: kvt.BlockLayout) -> bool:
    """Whether ``lay``'s parts lie inside one block stride (vLLM's cross-layer layout: one
    part per layer, side by side in each block) rather than in separate areas (K/V halves).
    Unchanged by :func:`head_slice` (it shifts every base alike), so a layout and its head
    slices, and two peers with the same layout, order their segments alike."""
    bases = [b for _, b in lay.parts]
    return len(bases) > 1 and max(bases) - min(bases) < lay.block_stride


def _attn_layout(inner_sizes: list[int], kv_heads: int, block_size: int) -> str:
    """Where the heads lie inside one block, from the sizes of its dimensions (outermost first)."""
    if kv_heads <= 0 or not inner_sizes:
        return ""
    if kv_heads == 1:
        return HEADS_OUTER  # one head: the whole block is that head's range
    if kv_heads == block_size or (kv_heads == 2 and inner_sizes.count(2) > 1):
        return AMBIGUOUS
    if inner_sizes[0] == kv_heads:
        return HEADS_OUTER
    if inner_sizes[0] == block_size:
        return TOKENS_OUTER
    return KV_OUTER if inner_sizes[0] == 2 else "other"


def check_uniform(layers: list[LayerMem]) -> None:
    """Every layer must share one block layout: one LayoutInfo describes them all."""
    parts, bb, kind = len(layers[0].bases), layers[0].block_bytes, layers[0].attn_layout
    for lm in layers:
        if len(lm.bases) != parts or lm.block_bytes != bb or lm.attn_layout != kind:
            raise KVLayoutError("all attention layers must share one KV layout (block bytes, K/V split)")


def _num_blocks_of(region_len: int, stride: int, regions: list[tuple[int, int]], block_bytes: int) -> int:
    """How many blocks fit the peer's region after the largest part base."""
    base = max(b for _, b in regions)
    return max(1, (region_len - base - block_bytes) // stride + 1)


def remote_layouts(peer: Any, layout: LayoutInfo) -> list[kvt.BlockLayout]:
    """The peer's layers as block layouts over its exported regions (raises the core's
    typed errors when the layout names regions the peer did not export)."""
    out = []
    for regions, stride in zip(layout.part_regions, layout.block_stride):
        parts = [(peer.region(rid), base) for rid, base in regions]
        out.append(kvt.BlockLayout(parts, layout.block_bytes,
                                   _num_blocks_of(peer.region(regions[0][0]).length, stride, regions,
                                                  layout.block_bytes),
                                   stride))
    return out


def block_segments(layouts: list[kvt.BlockLayout], block_ids: list[int], group_sizes: Sequence[int] = (),
                   layer_group: Sequence[int] = ()) -> kvt.Segments:
    """The byte ranges of ``block_ids`` in every layer and part, in one Segments (no
    Python loop per block: each layout maps the whole id array at once).

    Hybrid models (``group_sizes`` non-empty, see kv_groups.py): ``block_ids`` holds the
    ids of every KV cache group one after another, and layer *i* takes the ids of its
    group ``layer_group[i]``."""
    ids = np.asarray(block_ids, np.int64)
    if len(group_sizes) <= 1:
        return kvt.Segments.concat([_segments(lay, ids) for lay in layouts])
    if len(layer_group) != len(layouts):
        raise KVLayoutError(f"{len(layouts)} layers but a KV cache group is known for {len(layer_group)}")
    bounds = np.cumsum([0, *group_sizes])
    if bounds[-1] != len(ids):
        raise KVLayoutError(f"group sizes {list(group_sizes)} do not add up to {len(ids)} block ids")
    return kvt.Segments.concat([_segments(lay, ids[bounds[g]:bounds[g + 1]]) for lay, g in zip(layouts, layer_group)])


def _segments(lay: kvt.BlockLayout, ids: np.ndarray) -> kvt.Segments:
    """``lay.segments(ids)``, block by block for an interleaved (cross-layer) layout: block
    b's layers come one after another, so the core merges them (and consecutive blocks)
    into one byte range. Both sides of a transfer order alike: :func:`interleaved` is the
    same for both (the hand-shake refuses a cross-layer peer for a per-layer one)."""
    seg = lay.segments(ids)
    n = len(lay.parts)
    if n <= 1 or not interleaved(lay) or len(seg) == 0:
        return seg

    def block_major(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(n, -1).T).reshape(-1)

    return kvt.Segments(block_major(seg.region), block_major(seg.offset), block_major(seg.length))


def head_slice(layouts: list[kvt.BlockLayout], kv_heads: int, first: int, num: int) -> list[kvt.BlockLayout]:
    """The same layers restricted to heads ``[first, first + num)`` of the ``kv_heads`` in
    each block. Only valid for a HEADS_OUTER layout (checked at the hand-shake): each head
    is ``block_bytes / kv_heads`` bytes, so a head range is one byte range per block at a
    shifted base, with the same stride, and segments stay vectorised. All heads: unchanged
    (any layout)."""
    if first == 0 and num == kv_heads:
        return layouts
    if kv_heads <= 0 or not 0 <= first < first + num <= kv_heads:
        raise KVLayoutError(f"head range [{first}, {first + num}) outside the {kv_heads} KV heads of a block")
    out = []
    for lay in layouts:
        if lay.block_bytes % kv_heads:
            raise KVLayoutError(f"block of {lay.block_bytes} bytes does not split into {kv_heads} equal heads")
        hb = lay.block_bytes // kv_heads
        out.append(kvt.BlockLayout([(r, b + first * hb) for r, b in lay.parts], hb * num, lay.num_blocks,
                                   lay.block_stride))
    return out


def piece_layouts(local_layouts: list[kvt.BlockLayout], local: LayoutInfo | None, local_first: int,
                  remote_layouts: list[kvt.BlockLayout], remote: LayoutInfo | None, remote_first: int, num: int,
                  layer_group: Sequence[int], state_layers: frozenset[int], local_is_consumer: bool
                  ) -> tuple[list[kvt.BlockLayout], list[int], list[kvt.BlockLayout], list[int]]:
    """Both sides' layers for one piece of ``num`` attention heads (0: all), and the KV cache
    group of each: attention layers sliced to the piece's heads (:func:`head_slice`); Mamba
    state pages whole at equal TP sizes, else cut to the piece's share of the state
    (:mod:`.ssm_tp`). The two lists pair up layout by layout."""
    from .ssm_tp import cut_layouts, state_cuts

    ours = local.kv_heads if local is not None else 0
    theirs = remote.kv_heads if remote is not None else 0
    lo = head_slice(local_layouts, ours, local_first, num or ours)
    re = head_slice(remote_layouts, theirs, remote_first, num or theirs)
    lg = list(layer_group)
    cuts = state_cuts(local, remote, local_first, remote_first, num or ours, local_is_consumer) \
        if state_layers else None
    if cuts is None:
        return lo, lg, re, lg
    lo, lg_local = cut_layouts(local_layouts, lo, lg, state_layers, cuts[0])
    re, lg_remote = cut_layouts(remote_layouts, re, lg, state_layers, cuts[1])
    return lo, lg_local, re, lg_remote
