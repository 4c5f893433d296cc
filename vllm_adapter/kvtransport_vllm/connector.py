"""KVTransportConnector: vLLM's KVConnectorBase_V1 on top of kvtransport.

Configured only through ``kv_transfer_config`` (see docs/VLLM.md)::

    {"kv_connector": "KVTransportConnector", "kv_role": "kv_producer|kv_consumer|kv_both",
     "kv_connector_extra_config": {"backend": "loopback", "mode": "read", ...}}

The scheduler half (:mod:`.scheduler`) and the worker half (:mod:`.worker`) live in
separate modules; this class only routes vLLM's calls to the half of its role.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .block_sizes import attention_backends
from .config import ConnectorConfig, ConnectorConfigError, data_parallel_rank
from .kv_groups import check_group_kinds, group_infos
from .layerwise import LayerwisePlanner
from .messages import KVTransportMetadata
from .scheduler import KVTransportScheduler
from .spec_decode import refusal as spec_decode_refusal
from .process_tuning import tune_process
from .stats import KVTransportStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

__all__ = ["KVTransportConnector"]

# Version tolerance (docs/VLLM_COMPAT.md): optional vLLM features are detected, never
# inferred from the version string.
try:  # vLLM >= 0.32 reports failed receives by request id too
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older layouts
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:  # where hits come from, on vLLM's /metrics (connector prefix-cache hits by source)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _P2P_SOURCE: Any = CacheHitSource.P2P
except (ImportError, AttributeError):  # pragma: no cover - vLLM without hit sources
    _P2P_SOURCE = None

try:  # hybrid KV cache manager interface (request_finished_all_groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - layouts without HMA: plain mixin, same method

    class SupportsHMA:  # type: ignore[no-redef]
        pass


def _tp_info() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # no distributed group (tests, single process)
        return 0, 1


def _model_info(vllm_config: VllmConfig) -> Any:
    """What the hand-shake compares about the model: the served name (what a router sends
    both engines; a local path may differ between hosts), dtype and KV head geometry.
    None for configs without a model (tools)."""
    from .worker import ModelInfo

    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return None
    names = mc.served_model_name
    name = names[0] if isinstance(names, (list, tuple)) else names
    if getattr(mc, "use_mla", False):
        total = 1  # MLA: one latent "head", identical on every rank (tp_mapping's replicated case)
    else:
        total = mc.get_total_num_kv_heads()
    return ModelInfo(str(name or mc.model), str(mc.dtype).removeprefix("torch."), int(total),
                     int(mc.get_num_kv_heads(vllm_config.parallel_config)), int(mc.get_head_size()))


class KVTransportConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_vllm(vllm_config)
        if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
            # vLLM >= 0.33 refuses this itself (supports_sleep_mode below); 0.32 has no
            # such check and would free / remap KV memory the backend still exposes.
            raise ConnectorConfigError(
                "KVTransportConnector does not support sleep mode: the KV cache stays registered with "
                "the transport (peers read / write it directly), so it cannot be freed or remapped. "
                "Start vLLM without --enable-sleep-mode."
            )
        spec_refusal = spec_decode_refusal(vllm_config)
        if spec_refusal:
            raise ConnectorConfigError(spec_refusal)
        refused = check_group_kinds(kv_cache_config)
        if refused:
            raise ConnectorConfigError(
                "KVTransportConnector moves per-token KV blocks (full attention, MLA, sliding window) and "
                "Mamba / SSM state without prefix caching; this model has KV cache groups it cannot move "
                f"correctly: {'; '.join(refused)}. Change that setting, or serve this model without a KV "
                "connector (prefill and decode on one engine)."
            )
        groups = group_infos(kv_cache_config)
        #: layers of the groups moved (None: no config, every layer)
        self._moved_layers = {n for g in groups for n in g.layers} if groups else None
        #: Mamba / SSM state layers: registered as pages like attention blocks (ssm_state.py)
        self._state_layers = {n for g in groups if g.state for n in g.layers}
        #: their KV cache spec (vLLM gives every state layer of a model the same one)
        self._state_spec = next((g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", [])
                                 if self._state_layers & set(g.layer_names)), None)
        self._loaded_groups = tuple(g.index for g in groups) or (0,)
        ktc = vllm_config.kv_transfer_config
        if self.cfg.load_failure_policy is not None:
            # The scheduler reads kv_load_failure_policy right after building us.
            ktc.kv_load_failure_policy = self.cfg.load_failure_policy
        block_size = vllm_config.cache_config.block_size
        tp_rank, tp_size = _tp_info()
        dp_rank = data_parallel_rank(vllm_config)  # side-channel ports per (DP rank, TP rank)
        # Process-wide changes, made in one place (process_tuning.py): how vLLM's wait loops yield;
        # the thread switch interval (opt-in) in the worker's process, where our threads run.
        tune_process(self.cfg.vllm_spin_yield,
                     0.0 if role == KVConnectorRole.SCHEDULER else self.cfg.gil_switch_interval_s)
        self._scheduler: KVTransportScheduler | None = None
        self._worker: Any = None
        #: layer-wise WRITE: which prompt blocks each step completes (layerwise.py)
        self._layerwise: LayerwisePlanner | None = None
        if role == KVConnectorRole.SCHEDULER:
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            self._scheduler = KVTransportScheduler(self.cfg, block_size, tp_size, dp_rank, groups)
            if self.cfg.layerwise_write and self.cfg.is_producer:
                self._layerwise = LayerwisePlanner(self.cfg.engine_id, block_size)
        else:
            from .worker import KVTransportWorker

            num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or vllm_config.cache_config.num_gpu_blocks or 0)
            dtype = str(vllm_config.cache_config.cache_dtype)
            if dtype == "auto":
                dtype = str(vllm_config.model_config.dtype)
            self._worker = KVTransportWorker(self.cfg, block_size, num_blocks, dtype, tp_rank, tp_size,
                                             dp_rank, _model_info(vllm_config), groups)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33: sleep mode frees / remaps the KV cache; the transport keeps it
        registered for peers, so refuse (as NIXL and MoRIIO do) rather than expose freed
        memory. Ignored by vLLM 0.32, where ``__init__`` refuses instead."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The KV cache layout vLLM should allocate for us (``kv_cache_layout`` in
        kv_connector_extra_config, see :mod:`.layout_request`): heads outside tokens
        (``LBHNC``) by default, so engines of different TP sizes exchange KV on GPU too;
        ``BLHNC`` (cross-layer blocks) or nothing on request; nothing for MLA models. A
        bad value fails engine start-up naming the accepted ones."""
        from .layout_request import required_layout

        return required_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise WRITE posts from save_kv_layer, between layers: a full CUDA graph would
        replay the forward without those calls, so vLLM must capture piecewise graphs."""
        return (extra_config or {}).get("layerwise_write") is True

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)
        if self._layerwise is not None:
            self._layerwise.on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_connector_meta(scheduler_output)
        return self._layerwise.wrap(meta, scheduler_output) if self._layerwise is not None else meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        if self._layerwise is not None:
            self._layerwise.forget(request.request_id)
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        if self._layerwise is not None:
            self._layerwise.forget(request.request_id)
        # hybrid models: every group's blocks (a sliding-window group's out-of-window
        # blocks are vLLM's null block by now and are never moved)
        return self._scheduler.request_finished(request, tuple(list(g) for g in block_ids))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """Loaded tokens come from a peer engine's KV cache (vLLM's hits by source)."""
        if _P2P_SOURCE is None:  # pragma: no cover - vLLM without hit sources never asks
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {_P2P_SOURCE: num_external_tokens}

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # We transfer the request's own blocks of every transferable group.
        return self._loaded_groups

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._moved_layers is not None:  # groups vLLM does not transfer stay unregistered
            kv_caches = {n: t for n, t in kv_caches.items() if n in self._moved_layers}
        state = None
        if self._state_layers:
            from .ssm_state import as_pages, geometry

            geometries = {geometry(self._state_spec, v, self._worker.tp_size) for n, v in kv_caches.items()
                          if n in self._state_layers}
            if len(geometries) != 1:
                raise ConnectorConfigError("KVTransportConnector cannot move this hybrid model's Mamba state: its "
                                           f"state layers are laid out differently ({sorted(map(str, geometries))})")
            (state,) = geometries
            try:
                kv_caches = as_pages(kv_caches, self._state_layers)
            except ValueError as exc:
                raise ConnectorConfigError(f"KVTransportConnector cannot move this hybrid model's Mamba state: {exc}") \
                    from exc
        self._worker.register_kv_caches(kv_caches, attention_backends(self._vllm_config, kv_caches), state)

    def _meta(self) -> KVTransportMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVTransportMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's first worker call of a step, with the step's metadata, before the model runner
        prepares the step's inputs (vLLM 0.32-0.33): new work is taken here, so a READ starts
        before that preparation instead of after it (at concurrency 8 on kv-70b its wait to be
        taken fell by about 0.9 ms, docs/bench/E2E_LATENCY.md). We hold nothing a preemption
        must save.
        A runner that does not call this gets the same at ``bind_connector_metadata``: the
        worker takes each metadata object once."""
        if self._worker is not None and isinstance(kv_connector_metadata, KVTransportMetadata):
            self._take_step_work(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            # New work is taken before the forward at the latest: vLLM calls start_load_kv
            # for asynchronous loads only after the forward, and a READ posted there would
            # have its confirmation wait for the next step's forward. Taken before, the READ
            # and its confirmation overlap this step's forward. Loads stay asynchronous: the
            # request is not scheduled before done_recving.
            self._take_step_work(self._meta())

    def _take_step_work(self, meta: KVTransportMetadata | None) -> None:
        self._worker.may_wait_for_replies = False  # until start_load_kv says there is no forward
        self._worker.on_metadata(meta)
        self._worker.progress()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.on_metadata(self._meta())  # no-op when already taken by an earlier hook
        # A step without a forward (vLLM runs one while requests only wait for KV) has no
        # attention metadata: only then may get_finished wait briefly for a WRITE's
        # "written", since no running request is held up by it (worker._await_replies).
        self._worker.may_wait_for_replies = getattr(forward_context, "attn_metadata", None) is None
        self._worker.progress()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # layerwise_write: this layer's completed prompt blocks leave now (else a no-op)
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        # Producer: the prefill of this step has been computed, push what is ready.
        self._worker.progress()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_recving()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._worker.take_load_errors()
        # Several KV cache groups: vLLM cannot map block ids to requests and stops the engine
        # on any; the failed loads reach it by request id (failed_recving) instead.
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or []
        return set() if len(groups) > 1 else errors

    def get_kv_connector_stats(self) -> KVTransportStats | None:
        if self._worker is None:
            return None
        data = self._worker.take_stats()  # None when nothing changed since the last step
        return None if data is None else KVTransportStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """vLLM's hook for connector series on ``/metrics``: ``vllm:kvtransport_*`` (see
        :mod:`.prom_metrics`)."""
        from .prom_metrics import KVTransportPromMetrics

        return KVTransportPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTransportStats | None:
        return KVTransportStats(data) if data is not None else KVTransportStats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
