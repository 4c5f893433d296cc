"""Prometheus series of KVTransportConnector on vLLM's ``/metrics`` (``vllm:kvtransport_*``).

vLLM builds this once in its API server (``KVConnectorBase_V1.build_prom_metrics``) and
feeds it, per engine step that produced statistics, the dictionary the workers returned
from ``get_kv_connector_stats`` aggregated over TP ranks (schema:
:func:`.load_stats.new_stats`). Labels are vLLM's own (model name, engine index) plus the
connector's ``backend`` and ``mode``, so one dashboard serves every backend.

Series (docs/vllm/USAGE.md, "Metrics"):

* ``vllm:kvtransport_transfer_seconds`` / ``_transfer_bytes`` / ``_transfer_blocks`` —
  histograms per transfer (READ on the decode side, WRITE on the prefill side);
* ``vllm:kvtransport_write_after_prefill_seconds`` — histogram, WRITE on the prefill side:
  from the end of a request's prefill (its hold began) to the last byte of its write in the
  consumer's blocks -- the part of the push the prefill did not hide (layer-wise WRITE
  shortens it);
* ``vllm:kvtransport_remote_kv_wait_seconds`` — histogram: how long a request waited for
  its remote KV (blocks allocated -> load handed to vLLM), successful loads;
* ``vllm:kvtransport_load_phase_seconds{phase}`` — the same wait split into its phases
  (queued, handshake, transfer, confirm, report; ``total`` is the wait itself);
* ``vllm:kvtransport_outcomes_total{side, cause}`` — counter: how each load (``side="load"``)
  and hold (``side="hold"``) ended, ``cause="ok"`` or why not; side-channel messages
  refused are counted with ``side="side_channel"`` (``auth_refused``, ``malformed``,
  ``version_mismatch``, ``dropped``);
* ``vllm:kvtransport_holds_in_flight`` / ``_loads_in_flight`` — gauges.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from .load_stats import PHASES

__all__ = ["KVTransportPromMetrics"]

_SECONDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_BYTES = [2.0 ** e for e in range(12, 36, 2)]  # 4 KiB .. 16 GiB
_BLOCKS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]
#: side-channel refusal counters of the stats -> outcome cause
_SIDE_CHANNEL = {"sc_auth_failures": "auth_refused", "sc_malformed": "malformed",
                 "sc_version_mismatch": "version_mismatch", "sc_dropped": "dropped"}


class KVTransportPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        self._ours = [str(extra.get("backend", "loopback")), str(extra.get("mode", "read")).lower()]
        names = list(labelnames) + ["backend", "mode"]

        def hist(name: str, doc: str, buckets: list[float], more: tuple[str, ...] = ()) -> Any:
            return self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=names + list(more))

        self._transfer_s = self._per_engine(hist(
            "vllm:kvtransport_transfer_seconds", "Duration of one KV transfer (READ or WRITE).", _SECONDS))
        self._transfer_bytes = self._per_engine(hist(
            "vllm:kvtransport_transfer_bytes", "Bytes moved by one KV transfer.", _BYTES))
        self._transfer_blocks = self._per_engine(hist(
            "vllm:kvtransport_transfer_blocks", "KV blocks moved by one transfer.", _BLOCKS))
        self._after_prefill_s = self._per_engine(hist(
            "vllm:kvtransport_write_after_prefill_seconds",
            "WRITE: end of the prefill (hold began) -> last byte written to the consumer.", _SECONDS))
        self._wait_s = self._per_engine(hist(
            "vllm:kvtransport_remote_kv_wait_seconds",
            "Time a request waited for its remote KV (blocks allocated -> load reported).", _SECONDS))
        self._phase = hist("vllm:kvtransport_load_phase_seconds",
                           "Time a successful remote load spent in each phase.", _SECONDS, ("phase",))
        self._outcomes = self._counter_cls(
            name="vllm:kvtransport_outcomes_total",
            documentation="How remote loads, producer holds and side-channel messages ended, by cause.",
            labelnames=names + ["side", "cause"])
        self._holds = self._per_engine(self._gauge_cls(
            name="vllm:kvtransport_holds_in_flight", documentation="Finished prefills whose blocks are held "
            "for a consumer.", labelnames=names, multiprocess_mode="mostrecent"))
        self._loads = self._per_engine(self._gauge_cls(
            name="vllm:kvtransport_loads_in_flight", documentation="Remote loads in progress.",
            labelnames=names, multiprocess_mode="mostrecent"))

    def _labels(self, engine_idx: int) -> list[object]:
        return list(self.per_engine_labelvalues[engine_idx]) + self._ours

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*self._labels(idx)) for idx in self.per_engine_labelvalues}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for values, metric in ((d.get("transfer_s"), self._transfer_s), (d.get("transfer_bytes"), self._transfer_bytes),
                               (d.get("transfer_blocks"), self._transfer_blocks),
                               (d.get("write_after_prefill_s"), self._after_prefill_s)):
            for v in values or ():
                metric[engine_idx].observe(v)
        labels = self._labels(engine_idx)
        for phase in PHASES:
            for v in (d.get("phase_s") or {}).get(phase) or ():
                self._phase.labels(*labels, phase).observe(v)
                if phase == "total":
                    self._wait_s[engine_idx].observe(v)
        for key, n in (d.get("outcomes") or {}).items():
            side, _, cause = key.partition(":")
            self._outcomes.labels(*labels, side, cause).inc(n)
        for key, cause in _SIDE_CHANNEL.items():
            if d.get(key):
                self._outcomes.labels(*labels, "side_channel", cause).inc(d[key])
        if d.get("holds_in_flight") is not None:
            self._holds[engine_idx].set(d["holds_in_flight"])
        if d.get("loads_in_flight") is not None:
            self._loads[engine_idx].set(d["loads_in_flight"])
