"""The bench's KV cache: registered tensors, their block layout, verifiable contents.

Block contents are a cheap deterministic function of (request, part, block), so the
receiver recomputes what must have arrived and compares every byte.
"""

from __future__ import annotations

import numpy as np

import kvtransport as kvt

from .config import BenchConfig

__all__ = ["KVCache"]


class KVCache:
    """``layers`` tensors of shape (2, num_blocks, block_bytes) bytes, registered."""

    def __init__(self, agent: kvt.Agent, cfg: BenchConfig):
        self.cfg = cfg
        self.tensors = [np.zeros((2, cfg.num_blocks, cfg.block_bytes), np.uint8) for _ in range(cfg.layers)]
        self.regions = [agent.register(t) for t in self.tensors]
        half = cfg.num_blocks * cfg.block_bytes
        self.layout = kvt.BlockLayout([(r, off) for r in self.regions for off in (0, half)],
                                      cfg.block_bytes, cfg.num_blocks)

    @staticmethod
    def remote_layout(peer: kvt.Peer, cfg: BenchConfig) -> kvt.BlockLayout:
        half = cfg.num_blocks * cfg.block_bytes
        return kvt.BlockLayout([(r, off) for r in peer.regions for off in (0, half)],
                               cfg.block_bytes, cfg.num_blocks)

    def expected(self, req: int, nblocks: int) -> np.ndarray:
        """Content of request ``req``: (parts, blocks, block_bytes) from uint64 ramps."""
        words = self.cfg.block_bytes // 8
        parts = 2 * self.cfg.layers
        base = np.uint64((req + 1) * 0x9E3779B97F4A7C15 % (1 << 63))
        ramp = np.arange(parts * nblocks * words, dtype=np.uint64) + base
        return ramp.view(np.uint8).reshape(parts, nblocks, self.cfg.block_bytes)

    def fill(self, req: int, blocks: np.ndarray) -> None:
        exp = self.expected(req, blocks.size)
        for layer, t in enumerate(self.tensors):
            t[0, blocks] = exp[2 * layer]
            t[1, blocks] = exp[2 * layer + 1]

    def verify(self, req: int, blocks: np.ndarray) -> bool:
        exp = self.expected(req, blocks.size)
        return all(np.array_equal(t[0, blocks], exp[2 * i]) and np.array_equal(t[1, blocks], exp[2 * i + 1])
                   for i, t in enumerate(self.tensors))

    def scrub(self, blocks: np.ndarray) -> None:
        for t in self.tensors:
            t[:, blocks] = 0
