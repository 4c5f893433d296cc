"""Speculative decoding is refused when the engine starts, not at its first request.

What a user sees: an engine configured with ``--speculative-config`` and
KVTransportConnector fails to start with a message naming the setting and the fix, for a
drafter with KV of its own (a draft model); vLLM builds the connector while building the scheduler, so the refusal comes
before any request. n-gram drafting starts (proven end to end: tests/e2e/test_model_kinds.py,
kind ``ngram``).
"""

from __future__ import annotations

import pytest

import harness
from kvtransport_vllm.config import ConnectorConfigError
from vllm.config import SpeculativeConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager


@pytest.mark.parametrize(("spec", "why"), [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "keeps KV cache layers of its own"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}, None),
])
def test_speculative_decoding_is_refused_at_start(spec, why):
    import torch
    from kvtransport_vllm.plugin import register

    register()
    cfg = harness.make_vllm_config("kv_consumer", {"backend": "loopback", "side_channel_port": harness.free_port_base(4)})
    if spec["method"] == "draft_model":
        spec = {**spec, "model": harness.tiny_model_dir()}
    cfg.speculative_config = SpeculativeConfig(target_model_config=cfg.model_config,
                                               target_parallel_config=cfg.parallel_config, **spec)
    cfg.cache_config.num_gpu_blocks = 16
    full = FullAttentionSpec(block_size=16, num_kv_heads=harness.KV_HEADS, head_size=harness.HEAD_SIZE,
                             dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}" for i in range(harness.NUM_LAYERS)], full)])
    def build() -> None:
        s = Scheduler(vllm_config=cfg, kv_cache_config=kcc, log_stats=False,
                      structured_output_manager=StructuredOutputManager(cfg), block_size=16)
        s.connector.shutdown()

    if why is None:
        build()  # accepted
        return
    with pytest.raises(ConnectorConfigError, match=f"speculative decoding \\(method '{spec['method']}'\\).*{why}"
                       ".*without --speculative-config"):
        build()
