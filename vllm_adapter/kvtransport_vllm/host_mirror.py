"""The host mirror's memory (host staging, :mod:`.staging`): which device bytes it
copies, the one allocation that holds them, and the pinned scratch device copies pass
through.

* :func:`plan_mirrors` — one mirror range per *distinct* device byte range: the KV cache
  groups of a hybrid model are views of one allocation that overlay each other, so a
  per-layer mirror would multiply host memory and write rows the transport never filled
  over another group's blocks.
* :func:`pin_host_buffer` — all ranges (and the scratch) live in one exact-size host
  allocation, page-locked in place (``cudaHostRegister``) rather than taken from torch's
  pinned allocator, which rounds each allocation up to a power of two and keeps it.
* :class:`PinnedSlots` — the fixed scratch at the end of that allocation, cut into slots
  that device copies go through in slot-sized runs of blocks, so the pinned memory is
  known at start-up whatever a step moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from .config import ConnectorConfigError
from .fences import Fence
from .kv_layout import LayerMem

__all__ = ["MIRROR_ALIGN", "SCRATCH_BYTES", "SCRATCH_SLOTS", "MirrorPlan", "MirrorRange", "PinnedSlots",
           "pin_host_buffer", "plan_mirrors", "release_pinned", "row_bytes", "scratch_slot_bytes"]

#: Where each distinct range starts in the host allocation: a page boundary (any dtype's
#: alignment, and what DMA engines like)
MIRROR_ALIGN = 4096
#: cudaHostRegisterPortable: the pages count as pinned for every CUDA context of the process
_HOST_REGISTER_PORTABLE = 1
#: Pinned scratch the device copies go through (a device cache only), in this many slots:
#: a slot is reused once the copies that used it are done, so at most this much is in
#: flight; a step that moves more waits for its oldest slot (inside vLLM's exemption)
SCRATCH_BYTES = 256 << 20
SCRATCH_SLOTS = 4


# ------------------------------------------------------------------ the mirror's layout
@dataclass(frozen=True)
class MirrorRange:
    """One distinct device byte range (the layer views of one allocation that overlap or
    touch, merged) and where its copy starts in the host allocation."""

    device_start: int
    nbytes: int
    host_offset: int


@dataclass(frozen=True)
class MirrorPlan:
    """The host mirror as one allocation: each distinct range once, at an aligned offset."""

    ranges: list[MirrorRange]
    #: per layer: the index of the range it lies in
    layer_range: list[int]
    #: bytes of the one host allocation
    total_bytes: int

    @property
    def mirrored_bytes(self) -> int:
        """Device bytes the mirror copies (the distinct ranges, without alignment)."""
        return sum(r.nbytes for r in self.ranges)

    def host_offset(self, layer: int, addr: int) -> int:
        """Where the layer whose view starts at device address ``addr`` starts in the host allocation."""
        r = self.ranges[self.layer_range[layer]]
        return r.host_offset + (addr - r.device_start)


def _allocation_of(t: Any) -> tuple[str, int, int]:
    """What identifies the allocation a view belongs to: views of different allocations
    are never merged, even if their addresses happen to be adjacent."""
    dev = t.device
    return (dev.type, -1 if dev.index is None else int(dev.index), int(t.untyped_storage().data_ptr()))


def plan_mirrors(layers: Sequence[LayerMem], align: int = MIRROR_ALIGN) -> MirrorPlan:
    """One mirror range per distinct device byte range of ``layers``.

    Layers whose bytes overlap (vLLM's hybrid KV cache groups overlay one allocation; KV
    sharing layers are the same tensor) or touch inside one allocation share a range, so
    a layer's host view aliases exactly the other host views its device view aliases."""
    spans = sorted((_allocation_of(lm.tensor), lm.addr, lm.addr + lm.nbytes, i) for i, lm in enumerate(layers))
    ranges: list[list[int]] = []  # [start, end] per range, in address order
    keys: list[tuple[str, int, int]] = []
    layer_range = [0] * len(layers)
    for key, start, end, i in spans:
        if ranges and keys[-1] == key and start <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
            keys.append(key)
        layer_range[i] = len(ranges) - 1
    out, at = [], 0
    for start, end in ranges:
        out.append(MirrorRange(start, end - start, at))
        at += -(-(end - start) // align) * align
    return MirrorPlan(out, layer_range, at)


def pin_host_buffer(buf: Any, cudart: Any = None) -> Callable[[], None]:
    """Page-lock exactly ``buf``'s bytes in place (cudaHostRegister), so device copies from
    and to it are asynchronous DMA; returns the undo. The one device call of the mirror:
    torch's pinned allocator would round the size up to a power of two and keep it.
    ``cudart``: the CUDA runtime module (default torch's)."""
    if cudart is None:
        import torch

        cudart = torch.cuda.cudart()
    ptr, nbytes = int(buf.data_ptr()), int(buf.untyped_storage().nbytes())
    err = int(cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))
    if err != 0:
        raise ConnectorConfigError(
            f"KVTransportConnector: could not pin the {nbytes / 2**20:.1f} MiB host mirror of the KV cache "
            f"(cudaHostRegister returned CUDA error {err}): the host needs that much lockable memory per worker "
            "(check the memlock limit and free RAM), or use kv_buffer_device 'auto' with a backend that moves "
            "device memory (docs/GPU.md)")

    def unpin() -> None:
        cudart.cudaHostUnregister(ptr)

    return unpin


def release_pinned(unpin: Callable[[], None] | None, buf: Any) -> None:
    """Undo the page-lock before the buffer's memory can be freed (``buf`` is kept alive until then)."""
    if unpin is not None:
        unpin()
    del buf


def row_bytes(t: Any, block_dim: int) -> int:
    """Bytes of one block of ``t`` gathered densely (what ``index_select`` of one id makes)."""
    return int(t.numel() // max(1, t.shape[block_dim])) * t.element_size()


def scratch_slot_bytes(max_row: int, mirrored: int, budget: int = SCRATCH_BYTES, slots: int = SCRATCH_SLOTS,
                       align: int = MIRROR_ALIGN) -> int:
    """One scratch slot's size: the budget (no more than the mirror) split in ``slots``,
    never less than one block of the largest layer, page-aligned."""
    per = max(max_row, min(budget, mirrored) // slots)
    return -(-per // align) * align


class PinnedSlots:
    """Pinned scratch cut into slots handed out in turn. A slot is given back with the
    fence of the copies that use it (and what to do once they are done, e.g. scatter the
    rows a device -> host copy brought); taking it again first settles that, waiting for
    the fence inside ``sync_allowed`` if it is not ready yet."""

    def __init__(self, buf: Any, slots: int, sync_allowed: Callable[[], AbstractContextManager[Any]]) -> None:
        size = buf.numel() // slots
        self._slots = [buf[i * size:(i + 1) * size] for i in range(slots)]
        self._busy: list[tuple[Fence, Callable[[], None] | None] | None] = [None] * slots
        self._next = 0
        self._sync_allowed = sync_allowed
        self.slot_bytes = size

    def take(self) -> int:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        self._settle(i)
        return i

    def rows(self, i: int, shape: Sequence[int], dtype: Any) -> Any:
        """A dense tensor of ``shape`` at the start of slot ``i``."""
        n = 1
        for d in shape:
            n *= int(d)
        return self._slots[i].view(dtype)[:n].view(tuple(shape))

    def give_back(self, i: int, fence: Fence, then: Callable[[], None] | None = None) -> None:
        self._busy[i] = (fence, then)

    def drain(self) -> None:
        """Settle every slot (waiting where needed)."""
        for i in range(len(self._slots)):
            self._settle(i)

    def _settle(self, i: int) -> None:
        busy = self._busy[i]
        if busy is None:
            return
        fence, then = busy
        if not fence.query():
            with self._sync_allowed():
                fence.synchronize()
        self._busy[i] = None
        if then is not None:
            then()
