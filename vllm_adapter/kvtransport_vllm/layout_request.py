"""Which KV cache layout the connector asks vLLM for (``get_required_kvcache_layout``).

vLLM (>= 0.32) resolves one physical KV cache layout per engine, a permutation of the
logical ``[L, B, H, N, C]`` axes (layers, blocks, KV heads, tokens, K+V content;
``vllm/v1/kv_cache_layout.py``): ``VLLM_KV_CACHE_LAYOUT`` if set, else the connector's
request when the attention backends accept it, else the backends' first choice. On GPU
with FlashAttention that first choice is ``LBNHC`` ("NHD": tokens outside heads), where a
rank's heads are scattered over every token of a block, so prefill and decode engines of
different TP sizes cannot exchange head ranges. So we ask, per ``kv_cache_layout`` in
``kv_connector_extra_config``:

* ``heads_outer`` (default): ``LBHNC`` ("HND"): per layer, each head's tokens are one
  byte range per block; different TP sizes move one range per block, layer and piece.
* ``cross_layer``: ``BLHNC``: a block holds every layer's page (heads outside tokens in
  each), so an equal-TP load moves one byte range per block (per run of consecutive
  blocks) instead of one per block and layer; different TP sizes still work, one range
  per block, layer and piece. Both engines of a pair must choose it.
* ``vllm``: no request; vLLM's default applies (different TP sizes are then refused at
  the hand-shake unless that default keeps heads outside tokens, as the CPU backend does).

MLA models get no request: one latent per token, the same on every rank, so the layout
does not matter to us (as NixlConnector does). A backend that cannot use the requested
layout makes vLLM fall back to its own choice (it logs a warning); whatever vLLM
allocates, the worker describes it and the hand-shake refuses what cannot move.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LAYOUT_CONFIG_KEYS", "KV_CACHE_LAYOUTS", "layout_setting", "required_layout"]

#: kv_connector_extra_config key -> what it means (merged into config.EXTRA_CONFIG_KEYS)
LAYOUT_CONFIG_KEYS: dict[str, str] = {
    "kv_cache_layout": "heads_outer (default: ask vLLM for LBHNC, heads outside tokens, so engines of different TP "
    "sizes exchange KV), cross_layer (ask for BLHNC: all layers of a block in one byte range, fewest transfer "
    "descriptors; both engines must set it) or vllm (ask for nothing: vLLM's default layout)",
}

#: setting -> the vLLM layout name asked for (None: no request)
KV_CACHE_LAYOUTS: dict[str, str | None] = {"heads_outer": "LBHNC", "cross_layer": "BLHNC", "vllm": None}


def layout_setting(extra: dict[str, Any] | None) -> str:
    """The ``kv_cache_layout`` setting of ``extra`` (default ``heads_outer``); a value
    that is not one of :data:`KV_CACHE_LAYOUTS` raises the connector's config error."""
    from .config import ConnectorConfigError

    raw = (extra or {}).get("kv_cache_layout", "heads_outer")
    value = raw.strip().lower() if isinstance(raw, str) else raw
    if value not in KV_CACHE_LAYOUTS:
        raise ConnectorConfigError(
            f"KVTransportConnector: kv_cache_layout must be one of {sorted(KV_CACHE_LAYOUTS)}, got {raw!r}")
    return str(value)


def required_layout(vllm_config: Any) -> str | None:
    """The layout name to return from ``get_required_kvcache_layout`` for ``vllm_config``."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    setting = layout_setting(getattr(ktc, "kv_connector_extra_config", None))
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or getattr(mc, "use_mla", False):
        return None
    return KV_CACHE_LAYOUTS[setting]
