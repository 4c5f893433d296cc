"""The hand-shake's compatibility check: may bytes move between these two KV caches?

Both sides run it on the other's :class:`~.messages.LayoutInfo` (the consumer on the
producer's Welcome, the producer on the consumer's Hello), so a refusal is known within
one hand-shake round trip and no byte ever moves between incompatible caches. Every
refusal names both values and the fix.

Compared: served model name, model dtype, KV cache dtype, whether the layers
of a block lie together (vLLM's cross-layer layout), layer count, K/V split, total KV
heads, head size, the attention layout inside a block; block sizes must be equal or
divide one another (:mod:`.block_sizes` pairs them by token position, which needs
attention backends that keep tokens as rows, in one range per head or per block); with equal TP
sizes the bytes per token; with different TP sizes the head split (:mod:`.tp_mapping`)
and whether the side that must send or receive part of its heads keeps them as one byte
range per block (``kv_layout.HEADS_OUTER``), and for hybrid models whether the Mamba state
can be re-split by head (:mod:`.ssm_tp`). Fields a side does not know ("" / 0: a
worker built without a model config) are not compared.
"""

from __future__ import annotations

from .block_sizes import backends_problem, groups_refusal, sizes_problem
from .kv_layout import HEADS_OUTER, TOKENS_OUTER
from .messages import LayoutInfo
from .ssm_tp import resplit_problem
from .tp_mapping import TPMappingError, check_mapping

__all__ = ["refusal", "cross_layer"]

_FIX = {
    "model": "serve the same model (same --served-model-name) on both engines",
    "model_dtype": "start both engines with the same --dtype",
    "dtype": "start both engines with the same --kv-cache-dtype (and --dtype)",
    "num_layers": "serve the same model on both engines",
    "parts_per_layer": "use the same attention backend on both engines",
    "total_kv_heads": "serve the same model on both engines",
    "head_size": "serve the same model on both engines",
    "attn_layout": "use the same attention backend (KV cache layout) on both engines",
    "block_bytes": "serve the same model with the same dtype on both engines",
}


def _side(name: str, kv_heads: int, layout: str, other_heads: int) -> str:
    """Why side ``name`` cannot move part of its heads, or ""."""
    if kv_heads <= other_heads or layout == HEADS_OUTER:
        return ""
    return (f"the {name}'s KV layout is {layout or 'unknown'} ({kv_heads} heads per rank), so it cannot move "
            f"{other_heads} of them as one byte range per block; different TP sizes need heads outside tokens "
            "in each block (vLLM's LBHNC / HND layout, which the connector requests unless kv_cache_layout is "
            "'vllm', and no VLLM_KV_CACHE_LAYOUT overriding it), or equal TP sizes")


def shape_problem(layout: LayoutInfo) -> str:
    """Why ``layout`` cannot describe a KV cache ("" when it can): sizes that are not
    positive, per-layer lists of the wrong length, overlapping blocks. A peer's layout is
    only believed after this (a zero stride divided by, a negative base offset)."""
    if layout.block_bytes <= 0 or layout.num_layers <= 0 or layout.parts_per_layer <= 0 or layout.block_size <= 0:
        return (f"block_bytes {layout.block_bytes}, num_layers {layout.num_layers}, parts_per_layer "
                f"{layout.parts_per_layer} and block_size {layout.block_size} must all be positive")
    if not layout.part_regions and not layout.block_stride:
        return ""  # no memory described (a tool's worker): nothing to check
    if len(layout.part_regions) != layout.num_layers or len(layout.block_stride) != layout.num_layers:
        return (f"{len(layout.part_regions)} part lists and {len(layout.block_stride)} block strides for "
                f"{layout.num_layers} layers")
    for i, (regions, stride) in enumerate(zip(layout.part_regions, layout.block_stride)):
        if len(regions) != layout.parts_per_layer or any(rid < 0 or base < 0 for rid, base in regions):
            return f"layer {i}: {len(regions)} parts (want {layout.parts_per_layer}) or a negative region / offset"
        if stride < layout.block_bytes:
            return f"layer {i}: block stride {stride} is smaller than a block ({layout.block_bytes} bytes)"
    return ""


def cross_layer(layout: LayoutInfo) -> bool | None:
    """Whether ``layout`` is vLLM's cross-layer layout: one layout whose parts (the layers)
    lie side by side inside each block (kv_layout.interleaved); None when it describes no
    memory (a tool's worker)."""
    if not layout.part_regions or not layout.block_stride or not layout.part_regions[0]:
        return None
    bases = [b for _, b in layout.part_regions[0]]
    return len(bases) > 1 and max(bases) - min(bases) < layout.block_stride[0]


def refusal(ours: LayoutInfo, peer: LayoutInfo, us: str = "local", them: str = "peer") -> str:
    """Why ``ours`` and ``peer`` cannot exchange KV ("" when they can): each difference
    with both values and its fix."""
    shape = shape_problem(peer)
    if shape:
        return f"the {them}'s layout is not a KV cache: {shape} (a bug or a forged hand-shake)"
    diffs: list[str] = []

    def cmp(name: str, known: bool = True) -> None:
        a, b = getattr(ours, name), getattr(peer, name)
        if known and a != b:
            diffs.append(f"{name}: {us} {a!r} vs {them} {b!r} ({_FIX[name]})")

    cmp("model", bool(ours.model and peer.model))
    cmp("model_dtype", bool(ours.model_dtype and peer.model_dtype))
    a, b = cross_layer(ours), cross_layer(peer)
    if a is not None and b is not None and a != b:
        # the layer counts differ too (one layout of L parts vs L layouts): say why instead
        cross, other = (us, them) if a else (them, us)
        diffs.append(f"the {cross}'s KV cache keeps the pages of all layers of a block together (vLLM's "
                     f"cross-layer layout) and the {other}'s does not; set the same kv_cache_layout in "
                     "kv_connector_extra_config on both engines (and the same VLLM_KV_CACHE_LAYOUT, if set)")
        return "; ".join(diffs)
    for name in ("dtype", "num_layers", "parts_per_layer"):
        cmp(name)
    if ours.block_size != peer.block_size:
        diffs += _block_size_refusal(ours, peer, us, them)
    heads_known = ours.total_kv_heads > 0 and peer.total_kv_heads > 0
    cmp("total_kv_heads", heads_known)
    cmp("head_size", ours.head_size > 0 and peer.head_size > 0)
    cmp("attn_layout", bool(ours.attn_layout and peer.attn_layout) and ours.kv_heads > 1 and peer.kv_heads > 1)
    if ours.tp_size == peer.tp_size:
        if ours.block_bytes * peer.block_size != peer.block_bytes * ours.block_size:
            diffs.append(f"block_bytes: {us} {ours.block_bytes} per {ours.block_size} tokens vs {them} "
                         f"{peer.block_bytes} per {peer.block_size} ({_FIX['block_bytes']})")
        if ours.state is not None and peer.state is not None and ours.state != peer.state:
            # state pages are moved whole: laid out alike (a side that does not say is not compared)
            diffs.append(f"Mamba state layout: {us} {ours.state} vs {them} {peer.state} (serve the same model with "
                         "the same dtypes and VLLM_SSM_CONV_STATE_LAYOUT on both engines)")
    elif not diffs:
        diffs += _tp_refusal(ours, peer, us, them, heads_known)
    return "; ".join(diffs)


def _block_size_refusal(ours: LayoutInfo, peer: LayoutInfo, us: str, them: str) -> list[str]:
    """Why blocks of different sizes cannot be paired by token position ([] when they can)."""
    sizes = f"block_size: {us} {ours.block_size} vs {them} {peer.block_size}"
    why = sizes_problem(ours.block_size, peer.block_size)
    if why:
        return [f"{sizes}: {why}"]
    if ours.kv_groups > 1 or peer.kv_groups > 1:
        return [groups_refusal(*((peer.block_size, ours.block_size) if us == "decode" else
                                 (ours.block_size, peer.block_size)))]
    if cross_layer(ours) or cross_layer(peer):
        return [f"{sizes}: vLLM's cross-layer layout keeps every layer inside a block, so runs of tokens are not "
                "paired across block sizes; start both engines with the same --block-size, or use the heads-outer "
                "layout (kv_connector_extra_config kv_cache_layout: heads_outer)"]
    out = []
    for side, info in ((us, ours), (them, peer)):
        why = backends_problem(info.attn_backends)
        if why:
            out.append(f"{sizes}: the {side}'s blocks cannot be paired by token position: {why}; start both "
                       "engines with the same --block-size")
        elif info.kv_heads != 1 and info.attn_layout not in (HEADS_OUTER, TOKENS_OUTER):
            out.append(f"{sizes}: the {side}'s KV layout is {info.attn_layout or 'unknown'}, so its tokens are "
                       "not one byte range per head or per block; use equal block sizes, or the heads-outer "
                       "layout (kv_connector_extra_config kv_cache_layout: heads_outer)")
    return out


def _tp_refusal(ours: LayoutInfo, peer: LayoutInfo, us: str, them: str, heads_known: bool) -> list[str]:
    tp = f"tp_size: {us} {ours.tp_size} vs {them} {peer.tp_size}"
    if not heads_known or ours.kv_heads <= 0 or peer.kv_heads <= 0:
        return [f"{tp}, and the {them if peer.total_kv_heads <= 0 else us} did not say its KV head count "
                "(needed to map heads across TP sizes); upgrade kvtransport on both engines or use equal TP sizes"]
    out = []
    for side, info in ((us, ours), (them, peer)):
        try:
            check_mapping(info.total_kv_heads, info.tp_size, f"{side} TP")
        except TPMappingError as exc:
            out.append(f"{tp}: {exc}")
    if out:
        return out
    if ours.block_bytes * peer.kv_heads * peer.block_size != peer.block_bytes * ours.kv_heads * ours.block_size:
        out.append(f"{tp}: bytes per head and token differ ({us} "
                   f"{ours.block_bytes // (ours.kv_heads * ours.block_size)} vs {them} "
                   f"{peer.block_bytes // (peer.kv_heads * peer.block_size)}); serve the same model with the same "
                   "dtype on both engines")
    for side, info, other in ((us, ours, peer), (them, peer, ours)):
        why = _side(side, info.kv_heads, info.attn_layout, other.kv_heads)
        if why:
            out.append(f"{tp}: {why}")
    why = resplit_problem(ours.state, peer.state, (ours.tp_size, peer.tp_size), (ours.kv_heads, peer.kv_heads))
    if why:
        out.append(f"{tp}: {why}")
    return out
