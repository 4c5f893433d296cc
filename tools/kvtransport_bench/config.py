"""What a bench run does (:class:`BenchConfig`) and what it measured (:class:`ModeResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BenchConfig", "ModeResult"]


@dataclass
class BenchConfig:
    """Shape of the KV cache and of the run.

    ``layers`` layers, each one registered tensor holding K and V halves of ``num_blocks``
    blocks of ``block_bytes`` (two layout parts per layer, as vLLM's paged caches lie).
    Each request moves ``blocks_per_request`` scattered blocks in every part.
    """

    backend: str = "loopback"
    backend_options: dict[str, Any] = field(default_factory=dict)
    layers: int = 32
    num_blocks: int = 128
    block_bytes: int = 32 * 1024  # 16 tokens x 8 KV heads x 128 dims x 2 bytes
    blocks_per_request: int = 32
    requests: int = 16
    warmup: int = 2
    modes: tuple[str, ...] = ("read", "write")
    timeout_s: float = 60.0
    port: int = 0
    seed: int = 0
    #: Cluster secret for the side channel; run_bench makes a random one per run.
    secret: bytes = b""

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    @property
    def request_bytes(self) -> int:
        return 2 * self.layers * self.blocks_per_request * self.block_bytes


@dataclass
class ModeResult:
    """One mode's figures: throughput, latency percentiles, blocks verified, failures."""

    mode: str
    requests: int
    bytes_per_request: int
    gbps: float
    latency_ms: dict[str, float]
    verified_blocks: int
    failed: int
