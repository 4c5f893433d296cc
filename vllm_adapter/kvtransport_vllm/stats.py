"""Connector statistics reported through vLLM's ``get_kv_connector_stats``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["KVTransportStats"]

_SUMS = ("bytes", "transfers", "failures", "loads_ok", "leases_expired", "latency_s_sum",
         "sc_auth_failures", "sc_malformed", "sc_version_mismatch", "sc_dropped")


class KVTransportStats(KVConnectorStats):
    """Counters since the last report: bytes moved, transfers posted, failed loads,
    successful loads and their latency (sum and max), producer leases that lapsed, and
    side-channel messages refused (failed authentication, malformed, wrong protocol
    version) or dropped unanswered by the refusal rate limit, so that a peer with the
    wrong secret, or a flood, shows in vLLM's metrics and not only in a log line."""

    def __init__(self, data: dict[str, Any] | None = None):
        super().__init__(data=dict(data or {}))
        for k in _SUMS:
            self.data.setdefault(k, 0)
        self.data.setdefault("latency_s_max", 0.0)

    def reset(self) -> None:
        self.data = {k: 0 for k in _SUMS}
        self.data["latency_s_max"] = 0.0

    def aggregate(self, other: KVConnectorStats) -> KVTransportStats:
        for k in _SUMS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        self.data["latency_s_max"] = max(self.data.get("latency_s_max", 0.0), other.data.get("latency_s_max", 0.0))
        return self

    def reduce(self) -> dict[str, int | float]:
        ok = self.data["loads_ok"]
        return {
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

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _SUMS)
