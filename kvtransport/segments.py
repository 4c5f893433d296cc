"""Segment lists and block layouts, built and merged with numpy (never a loop per block).

A :class:`Segments` is three parallel arrays: region id, offset inside that region,
length. A transfer pairs a local and a remote ``Segments`` of the same shape; the core
merges runs that are contiguous on *both* sides into one segment before posting, so a
backend sees as few, as large, operations as the layout allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import InvalidSegmentsError

__all__ = ["Segments", "BlockLayout", "merge_pairs"]

_U64 = np.uint64
_I64 = np.int64


def _as_array(values: Any, dtype: type, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise InvalidSegmentsError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidSegmentsError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and arr.min() < 0:
        raise InvalidSegmentsError(f"{what} must not be negative (min {int(arr.min())})")
    return arr.astype(dtype, copy=False)


class Segments:
    """Parallel arrays (region ids, offsets, lengths); immutable once built."""

    __slots__ = ("region", "offset", "length")

    def __init__(self, region: Any, offset: Any, length: Any):
        offset_a = _as_array(offset, _U64, "offsets")
        length_a = _as_array(length, _U64, "lengths")
        region_a = _as_array(region, _I64, "region ids")
        n = offset_a.size
        if region_a.size == 1 and n != 1:
            region_a = np.full(n, region_a[0], dtype=_I64)
        if length_a.size == 1 and n != 1:
            length_a = np.full(n, length_a[0], dtype=_U64)
        if not (region_a.size == length_a.size == n):
            raise InvalidSegmentsError(
                f"region ids ({region_a.size}), offsets ({n}) and lengths ({length_a.size}) "
                "must have the same number of entries"
            )
        for a in (region_a, offset_a, length_a):
            a.flags.writeable = False
        self.region = region_a
        self.offset = offset_a
        self.length = length_a

    def __len__(self) -> int:
        return int(self.offset.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def __repr__(self) -> str:
        return f"Segments(n={len(self)}, nbytes={self.nbytes})"

    @classmethod
    def concat(cls, parts: Sequence[Segments]) -> Segments:
        if not parts:
            return cls(np.empty(0, _I64), np.empty(0, _U64), np.empty(0, _U64))
        return cls(
            np.concatenate([p.region for p in parts]),
            np.concatenate([p.offset for p in parts]),
            np.concatenate([p.length for p in parts]),
        )


def merge_pairs(
    local: Segments, remote: Segments
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs contiguous on both sides (same regions, each next segment starts where
    the previous ends, locally and remotely). Returns merged
    (local_region, local_offset, remote_region, remote_offset, length).

    Order is preserved; nothing is sorted, so the caller's order of operations holds.
    """
    n = len(local)
    if n <= 1:
        return local.region, local.offset, remote.region, remote.offset, local.length
    lr, lo, rr, ro, ln = local.region, local.offset, remote.region, remote.offset, local.length
    cont = (
        (lr[1:] == lr[:-1])
        & (rr[1:] == rr[:-1])
        & (lo[1:] == lo[:-1] + ln[:-1])
        & (ro[1:] == ro[:-1] + ln[:-1])
    )
    if not cont.any():
        return lr, lo, rr, ro, ln
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.add.reduceat(ln, starts)
    return lr[starts], lo[starts], rr[starts], ro[starts], lengths.astype(_U64, copy=False)


class BlockLayout:
    """How a paged KV cache lies in registered memory.

    ``parts`` lists ``(region, base_offset)``: one entry per layer, or two per layer when
    K and V are separate halves of one tensor. In every part, block ``b`` occupies
    ``[base + b*block_stride, base + b*block_stride + block_bytes)``. ``region`` is a
    local ``MemoryRegion`` or a peer's ``RemoteMemoryRegion`` (anything with ``.id`` and
    ``.length``), so the same helper builds both sides of a transfer.
    """

    def __init__(
        self,
        parts: Sequence[tuple[Any, int]],
        block_bytes: int,
        num_blocks: int,
        block_stride: int | None = None,
    ):
        stride = int(block_stride) if block_stride is not None else int(block_bytes)
        if block_bytes <= 0 or num_blocks <= 0:
            raise InvalidSegmentsError("block_bytes and num_blocks must be positive")
        if stride < block_bytes:
            raise InvalidSegmentsError(
                f"block_stride {stride} is smaller than block_bytes {block_bytes}: blocks would overlap"
            )
        norm = tuple((r, int(b)) for r, b in parts)
        if not norm:
            raise InvalidSegmentsError("a BlockLayout needs at least one (region, base_offset) part")
        span = (num_blocks - 1) * stride + block_bytes
        for region, base in norm:
            if base < 0 or base + span > region.length:
                raise InvalidSegmentsError(
                    f"layout part at offset {base} spans {span} bytes but region {region.id} "
                    f"has only {region.length}: check num_blocks / block_bytes / stride"
                )
        self.parts: tuple[tuple[Any, int], ...] = norm
        self.block_bytes = int(block_bytes)
        self.num_blocks = int(num_blocks)
        self.block_stride = stride
        self._region_ids = np.array([r.id for r, _ in norm], dtype=_I64)
        self._bases = np.array([b for _, b in norm], dtype=_U64)

    def __repr__(self) -> str:
        return (
            f"BlockLayout(parts={len(self.parts)}, block_bytes={self.block_bytes}, "
            f"num_blocks={self.num_blocks}, block_stride={self.block_stride})"
        )

    def segments(self, block_ids: Any) -> Segments:
        """Segments for ``block_ids`` in every part: part-major, then block order."""
        ids = np.asarray(block_ids)
        if ids.ndim != 1:
            ids = ids.reshape(-1)
        if ids.size and (ids.dtype.kind not in "iu"):
            raise InvalidSegmentsError(f"block ids must be integers, got dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise InvalidSegmentsError(
                f"block ids must lie in [0, {self.num_blocks}); got min {int(ids.min())}, "
                f"max {int(ids.max())}"
            )
        ids = ids.astype(_U64, copy=False)
        nparts = len(self.parts)
        offsets = (self._bases[:, None] + ids[None, :] * _U64(self.block_stride)).reshape(-1)
        regions = np.repeat(self._region_ids, ids.size)
        lengths = np.full(nparts * ids.size, self.block_bytes, dtype=_U64)
        return Segments(regions, offsets, lengths)
