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
positions) or with speculative-decoding state blocks; refused per request: a peer of
another TP size (the state's heads would have to be re-split).
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_state_spec", "refusals", "as_pages", "truncate_prefill", "loadable_tokens"]


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
