"""Hybrid models (issue 14, point 4): a full-attention KV cache group and a sliding-window
group under vLLM's hybrid KV cache manager, with real Schedulers and workers.

The engines here are one model with layer 0 sliding window (group 0, 32 tokens = 2 blocks
of 16) and layer 1 full attention (group 1), in the order vLLM gives such a Llama's groups. Each group has its own block ids; vLLM
replaces the blocks a sliding-window group no longer needs by its null block. What a
user checks: the request reaches RUNNING on the decode side with its KV loaded (not
recomputed), every full-attention block and every sliding-window block inside the window
equals what the prefill side computed, only the in-window blocks of the sliding-window
group were moved (bytes counted by the connector), and no block leaked on either side.
"""

from __future__ import annotations

import pytest

from harness import HEAD_SIZE, KV_HEADS, Pair, prompt_of

WINDOW = 32
BLOCK = 16
BLOCK_BYTES = KV_HEADS * BLOCK * 2 * HEAD_SIZE * 4  # one block of one layer, float32


def _moved_bytes(engine) -> int:
    total = 0
    for kvo in engine.kv_outputs:
        stats = kvo.kv_connector_stats
        if stats is not None and getattr(stats, "data", None):
            total += int(stats.data.get("bytes", 0))
    return total


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("n_tokens", [20, 150])
def test_sliding_window_group_moves_only_the_window(mode, n_tokens):
    pair = Pair(mode, sliding_window=WINDOW)
    try:
        prompt = prompt_of(n_tokens, seed=n_tokens)
        params = pair.prefill("r1", prompt)
        pair.C.add("r1", prompt, 4, params)
        checks = pair.run_to_end_checking_kv("r1", prompt)
        assert checks == [[]], f"decode KV differs from the prefill's in blocks {checks}"
        assert pair.C.first_start["r1"] > 0, "the decode side recomputed instead of loading"
        n_blocks = -(-n_tokens // BLOCK)
        n_window = min(n_blocks, -(-WINDOW // BLOCK) + 1)  # the in-window tail, +1 for a window across blocks
        assert _moved_bytes(pair.C) + _moved_bytes(pair.P) == (n_blocks + n_window) * BLOCK_BYTES
        pair.drain()
        pair.assert_no_leak()
    finally:
        pair.close()
