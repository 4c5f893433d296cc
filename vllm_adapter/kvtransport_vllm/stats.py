"""Connector statistics reported through vLLM's ``get_kv_connector_stats``.

The dictionary's schema is :func:`.load_stats.new_stats`: running sums (bytes, transfers,
failures, ...), per-transfer and per-load observations (lists, exported as Prometheus
histograms by :mod:`.prom_metrics`), outcome counts by side and cause, and the in-flight
gauges. vLLM aggregates one dictionary per TP worker each step, and again over a logging
interval, through :meth:`KVTransportStats.aggregate`.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .load_stats import PHASES, stats_empty

__all__ = ["KVTransportStats"]

_SUMS = ("bytes", "transfers", "failures", "loads_ok", "leases_expired", "latency_s_sum",
         "sc_auth_failures", "sc_malformed", "sc_version_mismatch", "sc_dropped")
_LISTS = ("transfer_s", "transfer_bytes", "transfer_blocks", "write_after_prefill_s")
_GAUGES = ("holds_in_flight", "loads_in_flight")


class KVTransportStats(KVConnectorStats):
    """Counters since the last report: bytes moved, transfers posted, failed loads,
    successful loads and their latency (sum and max), producer leases that lapsed, and
    side-channel messages refused (failed authentication, malformed, wrong protocol
    version) or dropped unanswered by the refusal rate limit, so that a peer with the
    wrong secret, or a flood, shows in vLLM's metrics and not only in a log line; plus
    each transfer's duration, bytes and blocks, each load's phase timings, outcome counts
    by cause, and the holds and loads in flight (when they changed)."""

    def __init__(self, data: dict[str, Any] | None = None):
        super().__init__(data=dict(data or {}))
        self._fill()

    def _fill(self) -> None:
        d = self.data
        for k in _SUMS:
            d.setdefault(k, 0)
        d.setdefault("latency_s_max", 0.0)
        for k in _LISTS:
            d[k] = list(d.get(k) or [])
        phases = d.get("phase_s") or {}
        d["phase_s"] = {p: list(phases.get(p) or []) for p in PHASES}
        d["outcomes"] = dict(d.get("outcomes") or {})
        for k in _GAUGES:
            d.setdefault(k, None)

    def reset(self) -> None:
        self.data = {}
        self._fill()

    def aggregate(self, other: KVConnectorStats) -> KVTransportStats:
        o = other.data
        d = self.data
        for k in _SUMS:
            d[k] = d.get(k, 0) + o.get(k, 0)
        d["latency_s_max"] = max(d.get("latency_s_max", 0.0), o.get("latency_s_max", 0.0))
        for k in _LISTS:
            d[k] = list(d.get(k) or []) + list(o.get(k) or [])
        for p in PHASES:
            d["phase_s"][p] = d["phase_s"][p] + list((o.get("phase_s") or {}).get(p) or [])
        for key, n in (o.get("outcomes") or {}).items():
            d["outcomes"][key] = d["outcomes"].get(key, 0) + n
        for k in _GAUGES:  # TP workers of one step: the engine's total is their sum
            if o.get(k) is not None:
                d[k] = (d.get(k) or 0) + o[k]
        return self

    def reduce(self) -> dict[str, int | float]:
        ok = self.data["loads_ok"]
        out: dict[str, int | float] = {
            "kv_bytes": int(self.data["bytes"]),
            "kv_transfers": int(self.data["transfers"]),
            "kv_load_failures": int(self.data["failures"]),
            "kv_loads_ok": int(ok),
            "kv_leases_expired": int(self.data["leases_expired"]),
            "kv_side_channel_auth_failures": int(self.data["sc_auth_failures"]),
            "kv_side_channel_malformed": int(self.data["sc_malformed"]),
            "kv_side_channel_version_mismatch": int(self.data["sc_version_mismatch"]),
            "kv_side_channel_dropped": int(self.data["sc_dropped"]),
            "avg_load_latency_ms": round(1000.0 * self.data["latency_s_sum"] / ok, 3) if ok else 0.0,
            "max_load_latency_ms": round(1000.0 * self.data["latency_s_max"], 3),
        }
        tail = self.data["write_after_prefill_s"]
        if tail:
            out["avg_write_after_prefill_ms"] = round(1000.0 * sum(tail) / len(tail), 3)
        for p, values in self.data["phase_s"].items():
            if values:
                out[f"avg_{p}_ms"] = round(1000.0 * sum(values) / len(values), 3)
        return out

    def is_empty(self) -> bool:
        return stats_empty(self.data) and all(self.data.get(k) is None for k in _GAUGES)
