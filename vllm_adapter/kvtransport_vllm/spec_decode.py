"""Speculative decoding: which settings the connector refuses at start-up, and why.

A drafter that keeps KV of its own (EAGLE / EAGLE-3, MTP, a draft model, hidden-state
extraction: vLLM's ``SpeculativeConfig.uses_draft_kv_cache()``) adds KV cache layers whose
content at the prompt's positions is derived from the target model's hidden states shifted
by one token, and whose last positions hold unverified draft tokens on the prefill engine;
multi-module MTP also changes how many prompt tokens the prefill engine may compute. None
of that is proven to arrive right on a decode engine here (no tokens-identical run), so it
is refused. Drafters without KV keep only the target model's KV, which is what the
connector moves, and propose from token ids (n-gram) the decode engine has in full: n-gram
is accepted (greedy tokens shown equal to one engine's without speculative decoding, end to
end). The other KV-free drafters (suffix, Medusa, MLP speculator) have no such run yet and
are refused until one does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["refusal", "ACCEPTED_METHODS"]

#: speculative methods shown to give a decode engine fed by this connector one engine's tokens
ACCEPTED_METHODS = frozenset({"ngram"})


def refusal(vllm_config: Any) -> str | None:
    """The start-up refusal for ``vllm_config``'s speculative decoding (None: none set)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    method = getattr(spec, "method", None) or "unknown"
    if method in ACCEPTED_METHODS:
        return None
    uses_kv = getattr(spec, "uses_draft_kv_cache", None)
    what = ("its drafter keeps KV cache layers of its own (draft tokens not yet verified, hidden states shifted by "
            "one token), which are not proven to arrive right on the decode engine"
            if callable(uses_kv) and uses_kv() else
            "tokens of a decode engine fed by this connector are not proven equal to one engine's with it")
    return (f"KVTransportConnector does not support speculative decoding (method {method!r}): {what}. "
            f"Start both engines without --speculative-config, or with method {', '.join(sorted(ACCEPTED_METHODS))}.")
