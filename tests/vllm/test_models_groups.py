"""KV cache groups vLLM does not transfer, and where loaded hits are reported from, with
real Schedulers and workers.

vLLM marks a KV cache group ``enable_kv_transfer=False`` when it rebuilds that group from
another one after a connector load (``KVCacheConfig.transfer_group_ids`` lists the others).
What a user checks: the transferable group's KV arrives intact, the other group's blocks are
neither read nor written on either side (its bytes are not counted and stay as the decode
engine left them), no block leaks, and vLLM's connector prefix-cache stats (``/metrics``
``vllm:external_prefix_cache_hits`` by source) count the loaded tokens as peer-to-peer hits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness import (
    HEAD_SIZE,
    KV_HEADS,
    Engine,
    Pair,
    free_port_base,
    kv_pattern,
    make_vllm_config,
    prompt_of,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
BLOCK_BYTES = KV_HEADS * BLOCK * 2 * HEAD_SIZE * 4  # one block of one layer, float32


class StatsKeepingScheduler(Scheduler):
    """vLLM's Scheduler, keeping every connector prefix-cache stats it reports (what the
    engine sends its front-end for ``/metrics``)."""

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = super().make_stats(*args, **kwargs)
        if stats is not None and stats.connector_prefix_cache_stats is not None:
            self.reported.append(stats.connector_prefix_cache_stats)
        return stats

    reported: list[Any]


class TwoGroupEngine(Engine):
    """An engine of the harness's two-layer model whose layer 1 is in a second KV cache
    group that vLLM does not transfer (``enable_kv_transfer=False``)."""

    def __init__(self, kv_role: str, extra: dict[str, Any], engine_id: str, num_blocks: int = 64) -> None:
        # Engine.__init__ builds its own one-group config: build this one instead.
        from kvtransport_vllm.plugin import register

        import harness

        register()
        if not harness._none_hash:
            from vllm.utils.hashing import sha256
            from vllm.v1.core.kv_cache_utils import init_none_hash

            init_none_hash(sha256)
            harness._none_hash = True
        self.block_size, self.num_blocks, self.engine_id = BLOCK, num_blocks, engine_id
        self.vllm_config = make_vllm_config(kv_role, extra, BLOCK, engine_id)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.sliding_window = None
        self.layer_group = [0, 1]
        self.full_group = 0
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
        groups = [KVCacheGroupSpec(["layers.0"], spec),
                  KVCacheGroupSpec(["layers.1"], spec, enable_kv_transfer=False)]
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        assert self.kv_cache_config.transfer_group_ids == (0,)
        self.scheduler = StatsKeepingScheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config), block_size=BLOCK,
        )
        self.scheduler.reported = []
        self.connector = self.scheduler.connector
        self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                          self.kv_cache_config)
        self.kv_caches = {f"layers.{i}": torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
                          for i in range(2)}
        self.worker.register_kv_caches(self.kv_caches)
        self.free0 = self.free_blocks()
        self.outputs, self.scheduled_log, self.kv_outputs = [], [], []
        self.first_start = {}
        self.no_row = lambda rid: False


def _pair(mode: str) -> Pair:
    pair = Pair.__new__(Pair)
    base = free_port_base(8)
    common = {"backend": "loopback", "mode": mode, "transfer_timeout_s": 5.0, "lease_s": 10.0,
              "load_failure_policy": "fail"}
    pair.p_port, pair.c_port = base, base + 4
    pair.P = TwoGroupEngine("kv_producer", {**common, "side_channel_port": base}, "P")
    try:
        pair.C = TwoGroupEngine("kv_consumer", {**common, "side_channel_port": base + 4}, "C")
    except BaseException:
        pair.P.close()
        raise
    pair.params = {}
    return pair


def _moved_bytes(engine: Engine) -> int:
    return sum(int(k.kv_connector_stats.data.get("bytes", 0)) for k in engine.kv_outputs
               if k.kv_connector_stats is not None and getattr(k.kv_connector_stats, "data", None))


def _layer_blocks_equal_pattern(engine: Engine, rid: str, prompt: list[int], layer: int) -> bool:
    ids = engine.scheduler.kv_cache_manager.get_block_ids(rid)[engine.layer_group[layer]]
    t = engine.kv_caches[f"layers.{layer}"]
    n = len(prompt)
    pos = torch.arange(n)
    want = kv_pattern(torch.tensor(prompt), pos, layer)
    got = t[torch.tensor(ids)[pos // BLOCK], :, pos % BLOCK, :]  # [n, heads, 2*head]
    return torch.equal(got, want[:, None, None].expand_as(got))


@pytest.mark.parametrize("mode", ["read", "write"])
def test_only_transferable_groups_move_and_hits_count_as_p2p(mode):
    pair = _pair(mode)
    try:
        prompt = prompt_of(70, seed=5)
        params = pair.prefill("r1", prompt)
        assert not isinstance(params["remote_block_ids"][0], list), "the non-transferable group was offered"
        pair.C.add("r1", prompt, 4, params)
        seen: list[tuple[bool, bool]] = []

        def loaded() -> bool:
            req = pair.C.scheduler.requests.get("r1")
            if (not seen and req is not None and "r1" in pair.C.first_start
                    and req.num_computed_tokens >= len(prompt)):
                # layer 1 (not transferable) in the loaded tokens' slots: what the decode
                # engine left there (zeros); it computed only the tokens from first_start
                loaded_pos = torch.arange(pair.C.first_start["r1"])
                ids = torch.tensor(pair.C.scheduler.kv_cache_manager.get_block_ids("r1")[1])
                layer1 = pair.C.kv_caches["layers.1"][ids[loaded_pos // BLOCK], :, loaded_pos % BLOCK, :]
                seen.append((_layer_blocks_equal_pattern(pair.C, "r1", prompt, 0),
                             bool(torch.count_nonzero(layer1) == 0)))
            return req is None

        pair.run(loaded, 30.0)
        assert pair.C.first_start["r1"] > 0, "the decode side recomputed instead of loading"
        assert seen and seen[0][0], "the transferable group's KV differs from the prefill's"
        assert seen[0][1], "the non-transferable group's blocks were written by the load"
        n_blocks = -(-len(prompt) // BLOCK)
        assert _moved_bytes(pair.C) + _moved_bytes(pair.P) == n_blocks * BLOCK_BYTES, \
            "bytes of the non-transferable group were moved"
        hits: dict[Any, int] = {}
        for s in pair.C.scheduler.reported:
            for src, n in s.hits_by_source.items():
                hits[src] = hits.get(src, 0) + n
        assert hits == {CacheHitSource.P2P: len(prompt)}, hits  # the tokens announced as loaded
        pair.drain()
        pair.assert_no_leak()
    finally:
        pair.close()


def test_chunked_local_attention_is_refused_at_start():
    """A KV cache group kind that is not per-token blocks from the prompt's start (chunked
    local attention) is refused when the engine builds its scheduler, naming the group."""
    from kvtransport_vllm.config import ConnectorConfigError
    from kvtransport_vllm.plugin import register
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    register()
    cfg = make_vllm_config("kv_consumer", {"backend": "loopback", "side_channel_port": free_port_base(4)}, BLOCK)
    cfg.cache_config.num_gpu_blocks = 16
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    local = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                      dtype=torch.float32, attention_chunk_size=64)
    kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layers.0"], local), KVCacheGroupSpec(["layers.1"], full)])
    with pytest.raises(ConnectorConfigError, match=r"ChunkedLocalAttentionSpec \(layers layers\.0\)"):
        Scheduler(vllm_config=cfg, kv_cache_config=kcc, log_stats=False,
                  structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)
