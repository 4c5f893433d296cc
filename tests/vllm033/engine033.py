"""tp_harness's multi-rank engine with the KV cache vLLM 0.33's GPU model runner would give it.

The layout is resolved by vLLM's own code, the way the engine core does it before it
profiles memory: every worker reports what its attention backends accept
(``get_supported_kv_cache_layouts`` of the FlashAttention backend), then
``resolve_kv_cache_layout`` picks one (``VLLM_KV_CACHE_LAYOUT``, else the connector's
``get_required_kvcache_layout`` when the backends accept it, else their first choice) and
each worker records it (``record_kv_cache_layout``, what the ``set_kv_cache_layout`` RPC
runs). The KV cache config comes from vLLM's planner (``get_kv_cache_config_from_groups``)
and each rank's per-layer tensors from ``allocate_kv_cache``, the function the GPU model
runner allocates with, here on the CPU: one backing buffer per rank, viewed per layer as
``[blocks, heads, tokens, K+V]`` with the strides of the resolved layout.

Everything else (Scheduler, connector workers, the stand-in forward writing known values
per global head, the byte checks) is tp_harness's ``TPEngine``. The dtype is float32 so
those values stay exact; FlashAttention computes in 16-bit types, but a layout is the same
permutation of the same axes whatever the element size.
"""

from __future__ import annotations

from typing import Any

import torch
import tp_harness
from tp_harness import HEAD_SIZE, NUM_LAYERS, TPEngine, _as_rank, heads_of_rank
from vllm.utils.hashing import sha256
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    record_kv_cache_layout,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

from kvtransport_vllm.plugin import register

LAYERS = [f"layers.{i}" for i in range(NUM_LAYERS)]


def resolve_layout(vllm_config: Any, specs: list[Any]) -> Any:
    """The layout vLLM's engine core resolves for ``vllm_config`` with FlashAttention
    workers (one list per worker, as the executor's RPC returns them)."""
    names = [layout.name for layout in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    return resolve_kv_cache_layout(vllm_config, [names], specs)


class FlashEngine033(TPEngine):
    """``TPEngine`` whose ranks hold vLLM 0.33's FlashAttention KV cache (module docstring)."""

    def __init__(self, kv_role: str, extra: dict[str, Any], *, tp: int, total_kv_heads: int,
                 block_size: int = 16, num_blocks: int = 48, engine_id: str | None = None,
                 policy: str = "recompute") -> None:
        # TPEngine's own fields, then vLLM 0.33's set-up instead of TPEngine's CPU tensors
        register()
        if not tp_harness._hash_ready:
            init_none_hash(sha256)
            tp_harness._hash_ready = True
        self.mla = False
        self.tp, self.total, self.block_size, self.num_blocks = tp, total_kv_heads, block_size, num_blocks
        self.width = 2 * HEAD_SIZE
        self.engine_id = engine_id or f"{kv_role}-tp{tp}"
        self.served_model_name, self.dtype = None, "float32"
        self.sliding_window, self.layer_group, self.full_group = None, [0] * NUM_LAYERS, 0  # one group
        self.mamba_groups, self.conv_dim_first = 0, False  # no Mamba layer
        self.vllm_config = self._config(kv_role, extra, policy)
        self.vllm_config.cache_config.num_gpu_blocks_override = num_blocks
        kv_heads = len(heads_of_rank(total_kv_heads, tp, 0))
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=HEAD_SIZE,
                                 dtype=torch.float32)
        #: the layout vLLM resolved (and recorded in cache_config.kv_cache_layout)
        self.layout = resolve_layout(self.vllm_config, [spec])
        groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        self.kv_cache_config = get_kv_cache_config_from_groups(self.vllm_config, groups,
                                                               available_memory=spec.page_size_bytes * NUM_LAYERS
                                                               * num_blocks)
        assert self.kv_cache_config.num_blocks == num_blocks
        # gpu_model_runner's kernel block size: block-outermost packing is never split
        kernel = (block_size if self.layout.is_block_outermost
                  else select_common_block_size(block_size, [FlashAttentionBackend], [spec]))
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   log_stats=True, structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=block_size)
        self.workers, self.caches = [], []
        for r in range(tp):
            record_kv_cache_layout(self.vllm_config.cache_config, self.layout.name)  # the worker's RPC
            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), self.layout, [kernel])
            with _as_rank(r, tp):
                w = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                        self.kv_cache_config)
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.caches.append(caches)  # [block, head, token, K+V]: what TPEngine writes and checks
        self.aggregator = KVOutputAggregator(tp)
        self.free0 = self.free_blocks()
        self.outputs = []
        self.first_start = {}
        self.last_outputs = []
        self.totals = [{} for _ in range(tp)]

    def segments_posted(self) -> int:
        """Byte ranges every rank's agent handed its backend (after the core's merging)."""
        return sum(int(w._worker.agent.stats()["segments_merged"]) for w in self.workers)
