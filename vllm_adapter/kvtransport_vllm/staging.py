"""Where the worker meets the device: ordering with the forward's stream, and host staging.

Two jobs, one small interface (:class:`KVDevice`) the worker calls at exactly two points:

* :meth:`KVDevice.before_send` — when the scheduler hands the worker finished prefills to
  hold (``on_metadata``), before any hold is offered or any WRITE of those blocks can be
  posted. The KV of those blocks was written by the forward's kernels on the device's
  current stream, asynchronously to the host; this returns only once that work is
  complete (and, with staging, once the blocks are copied into the host buffer the
  transport moves).
* :meth:`KVDevice.after_receive` — when loads are about to be reported to vLLM as
  finished (``get_finished``). With staging it enqueues the copy of the received blocks
  from the host buffer into the device cache and returns a :class:`Fence` the worker
  polls each step: a load is reported only once its fence is ready, so vLLM never
  schedules a forward that reads blocks still being copied, and the engine thread never
  waits for the forward in flight (async scheduling keeps its overlap).

Block ids come as vLLM's connector carries them (kv_groups.py): one flat list plus
``group_sizes``; on a hybrid model each layer copies only the ids of its own KV cache group.

Three implementations, chosen by :func:`make_kv_device` from the caches' memory kind and
the ``kv_buffer_device`` option:

* :class:`HostKV` — a CPU engine without staging: the forward has returned when the
  connector's hooks run, and loads land in the cache itself; both points are no-ops.
* :class:`DirectDeviceKV` — a GPU cache the transport moves itself: ``before_send``
  synchronizes the current stream of the cache's device; ``after_receive`` needs nothing
  (the transport's completion is when its device writes are done, see docs/GPU.md).
* :class:`HostStaging` — ``kv_buffer_device: cpu``: a host mirror of the KV cache is what
  gets registered; blocks are copied device -> host before sending and host -> device
  after receiving, with ``index_select`` / ``index_copy_`` over a block-id tensor (one call
  per layer and direction, never a Python loop per block). On a CPU engine it still really
  copies (synchronously, :class:`HostFence`), which is how it is tested without a GPU.

The mirror (:mod:`.host_mirror`) has one copy of each *distinct* device byte range, not
one per layer: since vLLM 0.32 the KV cache groups of a hybrid model are views of one
allocation that overlay each other (a block id belongs to one group at a time), and a
per-layer mirror both multiplied host memory and, copied back with every group's ids,
wrote rows the transport never filled over another group's blocks. All ranges live in
one exact-size host allocation, page-locked in place (:func:`pin_host_buffer`) rather
than taken from torch's pinned allocator, which rounds each allocation up to a power of
two and keeps it. With a device cache the same allocation ends with a fixed pinned
scratch (:class:`PinnedSlots`, ``SCRATCH_BYTES`` at most) that every device copy goes
through in slot-sized runs of blocks, so the pinned memory is known at start-up whatever
a step moves; a step moving more than the scratch holds waits for its oldest slot.

Deliberate waits for the device (``before_send``) run inside vLLM's ``gpu_sync_allowed()``
when vLLM has it, so ``VLLM_GPU_SYNC_CHECK=error`` does not fail the step on them; every
host -> device copy reads pinned memory, which that check requires of non-blocking copies.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from .fences import DeviceFence, Fence, HostFence
from .host_mirror import (
    MIRROR_ALIGN,
    SCRATCH_BYTES,
    SCRATCH_SLOTS,
    MirrorPlan,
    MirrorRange,
    PinnedSlots,
    pin_host_buffer,
    plan_mirrors,
    release_pinned,
    row_bytes,
    scratch_slot_bytes,
)
from .kv_groups import flatten, split
from .kv_layout import KVLayoutError, LayerMem

log = logging.getLogger(__name__)

__all__ = ["KVDevice", "HostKV", "DirectDeviceKV", "HostStaging", "make_kv_device", "current_stream_of",
           "Fence", "HostFence", "DeviceFence", "MirrorPlan", "MirrorRange", "plan_mirrors",
           "pin_host_buffer", "merge_group_ids", "vllm_sync_allowed", "PinnedSlots", "scratch_slot_bytes",
           "row_bytes", "MIRROR_ALIGN", "SCRATCH_BYTES", "SCRATCH_SLOTS"]


# ------------------------------------------------------------------ vLLM's sync check
def vllm_sync_allowed() -> Callable[[], AbstractContextManager[Any]]:
    """vLLM's ``gpu_sync_allowed`` (its ``VLLM_GPU_SYNC_CHECK`` exemption for deliberate
    host-device waits) when the installed vLLM has it, else a no-op context."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:
        return contextlib.nullcontext
    return gpu_sync_allowed


# ------------------------------------------------------------------ block ids per group
def merge_group_ids(jobs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> tuple[list[int], list[int]]:
    """Several jobs' ``(block ids, group sizes)`` as one: each group's ids of every job
    together, in the same flat-plus-sizes form (``[]`` sizes: one group)."""
    per_group: list[list[int]] = []
    for ids, sizes in jobs:
        for g, group_ids in enumerate(split(ids, sizes)):
            if g == len(per_group):
                per_group.append([])
            per_group[g] += group_ids
    return flatten(per_group) if per_group else ([], [])


# ------------------------------------------------------------------ the device policies
class KVDevice:
    """The two ordering points between the transport and the device (base: no-ops)."""

    #: the tensors to register with the transport (the KV caches themselves unless staged)
    def registered(self, layers: list[LayerMem]) -> list[LayerMem]:
        return layers

    def before_send(self, block_ids: Sequence[int], group_sizes: Sequence[int] = ()) -> None:
        """Return once the KV in ``block_ids`` is complete in the registered memory."""

    def after_receive(self, block_ids: Sequence[int], group_sizes: Sequence[int] = ()) -> Fence:
        """Start moving bytes that landed in the registered memory for ``block_ids`` into the
        KV cache; the returned fence is ready once they are there, visible to any forward
        vLLM launches afterwards."""
        return HostFence(done=True)

    def close(self) -> None:
        """Release what the policy holds (the pinned mirror); after the agent is closed."""

    def describe(self) -> str:
        return "direct"


class HostKV(KVDevice):
    """CPU KV cache moved directly: nothing runs asynchronously to the engine thread."""

    def describe(self) -> str:
        return "cpu cache, direct"


def current_stream_of(device: Any) -> Any:
    """The stream vLLM's forward ran on for ``device`` (the engine thread's current stream)."""
    import torch

    return torch.cuda.current_stream(device)


class DirectDeviceKV(KVDevice):
    """A GPU cache the transport reads and writes in place.

    ``before_send`` synchronizes the device's current stream: every kernel the forward
    enqueued before this point (including the last layer's KV write) has completed when
    it returns; a deliberate wait, so it runs inside vLLM's sync-check exemption.
    ``stream_of`` and ``sync_allowed`` are injectable so a test can record the calls."""

    def __init__(self, device: Any, stream_of: Callable[[Any], Any] = current_stream_of,
                 sync_allowed: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        self.device = device
        self._stream_of = stream_of
        self._sync_allowed = sync_allowed or vllm_sync_allowed()

    def before_send(self, block_ids: Sequence[int], group_sizes: Sequence[int] = ()) -> None:
        if len(block_ids):
            with self._sync_allowed():
                self._stream_of(self.device).synchronize()

    def describe(self) -> str:
        return f"device cache on {self.device}, direct (stream synchronized before holds and writes)"


class HostStaging(KVDevice):
    """Host mirror of the KV cache (pinned when the cache is on a device); the transport
    moves only the mirror.

    ``layer_group`` gives each layer's KV cache group (empty: one group), so each layer
    copies only its own group's blocks. The mirror is one allocation laid out by
    :func:`plan_mirrors`; each layer's host view has the device view's sizes and strides
    at the same place in its range."""

    def __init__(self, layers: list[LayerMem], layer_group: Sequence[int] = (),
                 stream_of: Callable[[Any], Any] = current_stream_of,
                 sync_allowed: Callable[[], AbstractContextManager[Any]] | None = None,
                 pin: Callable[[Any], Callable[[], None]] = pin_host_buffer) -> None:
        import torch

        if layer_group and len(layer_group) != len(layers):
            raise KVLayoutError(f"{len(layers)} layers but a KV cache group is known for {len(layer_group)}")
        self._torch = torch
        self._stream_of = stream_of
        self._sync_allowed = sync_allowed or vllm_sync_allowed()
        self.layers = layers
        self.layer_group = list(layer_group)
        dev = layers[0].tensor.device
        self.device = dev
        self.on_device = dev.type != "cpu"
        self.mirror = plan_mirrors(layers)
        slot = scratch_slot_bytes(max(row_bytes(lm.tensor, lm.block_dim) for lm in layers),
                                  self.mirror.mirrored_bytes) if self.on_device else 0
        #: the one host allocation: every layer's mirror view, then (device cache) the
        #: scratch slots; exactly this size, allocated unpinned, then page-locked in place
        self.buffer = torch.empty(self.mirror.total_bytes + slot * SCRATCH_SLOTS, dtype=torch.uint8, device="cpu")
        unpin = pin(self.buffer) if self.on_device else None
        self._finalizer = weakref.finalize(self, release_pinned, unpin, self.buffer)
        self._slots = PinnedSlots(self.buffer[self.mirror.total_bytes:], SCRATCH_SLOTS,
                                  self._sync_allowed) if self.on_device else None
        self.host: list[Any] = [self._host_view(i, lm) for i, lm in enumerate(layers)]
        #: layers actually copied: a view repeated in one group (KV sharing layers) once
        seen: set[tuple[Any, ...]] = set()
        self._copy: list[int] = []
        for i, lm in enumerate(layers):
            key = (lm.addr, tuple(lm.tensor.shape), tuple(lm.tensor.stride()), lm.tensor.dtype, self._group(i))
            if key not in seen:
                seen.add(key)
                self._copy.append(i)
        self.nbytes = int(self.buffer.numel())

    def _host_view(self, i: int, lm: LayerMem) -> Any:
        t = lm.tensor
        off = self.mirror.host_offset(i, lm.addr)
        item = t.element_size()
        if off % item:
            raise KVLayoutError(f"KV cache layer {i} starts {off} bytes into its allocation, not a multiple of "
                                f"its element size {item}: it cannot be mirrored")
        return self._torch.as_strided(self.buffer.view(t.dtype), tuple(t.shape), tuple(t.stride()), off // item)

    def _group(self, layer: int) -> int:
        return self.layer_group[layer] if self.layer_group else 0

    def registered(self, layers: list[LayerMem]) -> list[LayerMem]:
        out = []
        for lm, h in zip(layers, self.host):
            out.append(LayerMem(h, int(h.data_ptr()), lm.nbytes, list(lm.bases), lm.block_bytes,
                                lm.block_stride, "cpu", -1, lm.block_dim, lm.attn_layout))
        return out

    def _work(self, block_ids: Sequence[int],
              group_sizes: Sequence[int]) -> tuple[list[tuple[LayerMem, Any, Any, Any]], list[Any]]:
        """(layer, host view, host ids, device ids) for every layer with blocks to copy: its
        own group's ids; and the host id tensors a device copy reads (kept until it ends)."""
        torch = self._torch
        if len(group_sizes) <= 1:
            per_group = [list(block_ids)]
            group_of = [0] * len(self.layers)
        else:
            if not self.layer_group:
                raise KVLayoutError(f"block ids for {len(group_sizes)} KV cache groups, but the layers' groups "
                                    "are not known")
            per_group = split(block_ids, group_sizes)
            group_of = self.layer_group
        ids_of: dict[int, tuple[Any, Any]] = {}
        for g, ids in enumerate(per_group):
            if not ids:
                continue
            host_ids = torch.as_tensor(ids, dtype=torch.long)
            if self.on_device:  # pinned, so the copy to the device is asynchronous
                host_ids = host_ids.pin_memory()
                ids_of[g] = (host_ids, host_ids.to(self.device, non_blocking=True))
            else:
                ids_of[g] = (host_ids, host_ids)
        work = []
        for i in self._copy:
            g = group_of[i]
            if g in ids_of:
                work.append((self.layers[i], self.host[i], *ids_of[g]))
        return work, [h for h, _ in ids_of.values()]

    def _chunks(self, h: Any, dim: int, ids: Any, ids_dev: Any) -> Iterable[tuple[Any, Any, list[int]]]:
        """``ids`` in runs whose rows fit one scratch slot: (host ids, device ids, rows' shape)."""
        assert self._slots is not None
        per = max(1, self._slots.slot_bytes // row_bytes(h, dim))
        n = int(ids.numel())
        for a in range(0, n, per):
            shape = list(h.shape)
            shape[dim] = min(per, n - a)
            yield ids[a:a + per], ids_dev[a:a + per], shape

    def before_send(self, block_ids: Sequence[int], group_sizes: Sequence[int] = ()) -> None:
        """Device -> host for ``block_ids``: gather on the device (enqueued on the current
        stream, so after the forward that wrote them), copy into a pinned scratch slot, and
        once that copy is done scatter the rows into the mirror; returns when every slot is
        settled (the hold is offered right after: a deliberate wait)."""
        work, _ = self._work(block_ids, group_sizes)
        if not work:
            return
        if self._slots is None:
            for lm, h, ids, _ in work:
                h.index_copy_(lm.block_dim, ids, lm.tensor.index_select(lm.block_dim, ids))
            return
        slots, stream = self._slots, self._stream_of(self.device)
        for lm, h, ids, ids_dev in work:
            for hid, did, shape in self._chunks(h, lm.block_dim, ids, ids_dev):
                i = slots.take()
                rows = slots.rows(i, shape, h.dtype)
                rows.copy_(lm.tensor.index_select(lm.block_dim, did), non_blocking=True)
                slots.give_back(i, DeviceFence(stream), partial(h.index_copy_, lm.block_dim, hid, rows))
        slots.drain()

    def after_receive(self, block_ids: Sequence[int], group_sizes: Sequence[int] = ()) -> Fence:
        """Host -> device for ``block_ids``: gather the mirror's rows into a pinned scratch
        slot and enqueue their copy and scatter on the device's current stream; the fence is
        an event recorded after the last of them (a CPU cache: copied now, the fence is ready)."""
        work, keep = self._work(block_ids, group_sizes)
        if self._slots is None:
            for lm, h, ids, _ in work:
                lm.tensor.index_copy_(lm.block_dim, ids, h.index_select(lm.block_dim, ids))
            return HostFence(done=True)
        fence: Fence = HostFence(done=True)
        slots, stream, torch = self._slots, self._stream_of(self.device), self._torch
        for lm, h, ids, ids_dev in work:
            for hid, did, shape in self._chunks(h, lm.block_dim, ids, ids_dev):
                i = slots.take()
                rows = slots.rows(i, shape, h.dtype)
                torch.index_select(h, lm.block_dim, hid, out=rows)
                lm.tensor.index_copy_(lm.block_dim, did, rows.to(self.device, non_blocking=True))
                fence = DeviceFence(stream, keep)
                slots.give_back(i, fence)
        return fence

    def close(self) -> None:
        """Wait for copies still reading the scratch, then unpin (the memory is freed with us)."""
        if self._slots is not None and self._finalizer.alive:
            self._slots.drain()
        self._finalizer()

    def describe(self) -> str:
        m = self.mirror
        pinned = "pinned " if self.on_device else ""
        scratch = (f" and {self._slots.slot_bytes * SCRATCH_SLOTS / 2**20:.1f} MiB of copy scratch"
                   if self._slots is not None else "")
        return (f"host staging (kv_buffer_device=cpu): {self.nbytes / 2**20:.1f} MiB ({self.nbytes} bytes) of "
                f"{pinned}host memory in one allocation: a mirror of the {self.device} KV cache's "
                f"{len(m.ranges)} distinct device byte range(s) of {len(self.layers)} layers{scratch}")


def make_kv_device(layers: list[LayerMem], kv_buffer_device: str, layer_group: Sequence[int] = ()) -> KVDevice:
    """The device policy for these caches: staged if asked, else direct by memory kind."""
    if kv_buffer_device == "cpu":
        return HostStaging(layers, layer_group)
    if layers and layers[0].kind != "cpu":
        return DirectDeviceKV(layers[0].tensor.device)
    return HostKV()
