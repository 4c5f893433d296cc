"""Where the worker meets the device: ordering with the forward's stream, and host staging.

Two jobs, one small interface (:class:`KVDevice`) the worker calls at exactly two points:

* :meth:`KVDevice.before_send` — when the scheduler hands the worker finished prefills to
  hold (``on_metadata``), before any hold is offered or any WRITE of those blocks can be
  posted. The KV of those blocks was written by the forward's kernels on the device's
  current stream, asynchronously to the host; this returns only once that work is
  complete (and, with staging, once the blocks are copied into the host buffer the
  transport moves).
* :meth:`KVDevice.after_receive` — when loads are about to be reported to vLLM as
  finished (``get_finished``), before vLLM may schedule a forward that reads them. With
  staging it copies the received blocks from the host buffer into the device cache and
  waits for that copy.

Three implementations, chosen by :func:`make_kv_device` from the caches' memory kind and
the ``kv_buffer_device`` option:

* :class:`HostKV` — a CPU engine without staging: the forward has returned when the
  connector's hooks run, and loads land in the cache itself; both points are no-ops.
* :class:`DirectDeviceKV` — a GPU cache the transport moves itself: ``before_send``
  synchronizes the current stream of the cache's device; ``after_receive`` needs nothing
  (the transport's completion is when its device writes are done, see docs/GPU.md).
* :class:`HostStaging` — ``kv_buffer_device: cpu``: a host mirror of every KV tensor
  (same shape and strides, pinned when the cache is on a device) is what gets registered;
  blocks are copied device -> host before sending and host -> device after receiving,
  with ``index_select`` / ``index_copy_`` over a block-id tensor (one call per layer and
  direction, never a Python loop per block). On a CPU engine it still really copies,
  which is how it is tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .kv_layout import LayerMem

log = logging.getLogger(__name__)

__all__ = ["KVDevice", "HostKV", "DirectDeviceKV", "HostStaging", "make_kv_device", "current_stream_of"]


class KVDevice:
    """The two ordering points between the transport and the device (base: no-ops)."""

    #: the tensors to register with the transport (the KV caches themselves unless staged)
    def registered(self, layers: list[LayerMem]) -> list[LayerMem]:
        return layers

    def before_send(self, block_ids: Sequence[int]) -> None:
        """Return once the KV in ``block_ids`` is complete in the registered memory."""

    def after_receive(self, block_ids: Sequence[int]) -> None:
        """Return once bytes that landed in the registered memory for ``block_ids`` are in
        the KV cache, visible to any forward vLLM launches afterwards."""

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
    it returns. ``stream_of`` is injectable so a test can record the calls."""

    def __init__(self, device: Any, stream_of: Callable[[Any], Any] = current_stream_of) -> None:
        self.device = device
        self._stream_of = stream_of

    def before_send(self, block_ids: Sequence[int]) -> None:
        if len(block_ids):
            self._stream_of(self.device).synchronize()

    def describe(self) -> str:
        return f"device cache on {self.device}, direct (stream synchronized before holds and writes)"


class HostStaging(KVDevice):
    """Pinned host mirror of the KV cache; the transport moves only the mirror."""

    def __init__(self, layers: list[LayerMem], stream_of: Callable[[Any], Any] = current_stream_of) -> None:
        import torch

        self._torch = torch
        self._stream_of = stream_of
        self.layers = layers
        dev = layers[0].tensor.device
        self.device = dev
        self.on_device = dev.type != "cpu"
        self.host: list[Any] = []
        for lm in layers:
            t = lm.tensor
            # same sizes and strides: the mirror's blocks are laid out like the cache's
            self.host.append(torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                                 device="cpu", pin_memory=self.on_device))
        self.nbytes = sum(lm.nbytes for lm in layers)

    def registered(self, layers: list[LayerMem]) -> list[LayerMem]:
        out = []
        for lm, h in zip(layers, self.host):
            out.append(LayerMem(h, int(h.data_ptr()), lm.nbytes, list(lm.bases), lm.block_bytes,
                                lm.block_stride, "cpu", -1, lm.block_dim))
        return out

    def _ids(self, block_ids: Sequence[int]) -> tuple[Any, Any]:
        torch = self._torch
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        return ids, (ids.to(self.device) if self.on_device else ids)

    def before_send(self, block_ids: Sequence[int]) -> None:
        """Device -> host for ``block_ids``: gather on the device (enqueued on the current
        stream, so after the forward that wrote them), then scatter into the mirror."""
        if not len(block_ids):
            return
        ids, ids_dev = self._ids(block_ids)
        for lm, h in zip(self.layers, self.host):
            gathered = lm.tensor.index_select(lm.block_dim, ids_dev)
            h.index_copy_(lm.block_dim, ids, gathered.to("cpu"))  # .to waits for the stream
        if self.on_device:
            self._stream_of(self.device).synchronize()

    def after_receive(self, block_ids: Sequence[int]) -> None:
        """Host -> device for ``block_ids``, waited for before the load is reported."""
        if not len(block_ids):
            return
        ids, ids_dev = self._ids(block_ids)
        for lm, h in zip(self.layers, self.host):
            rows = h.index_select(lm.block_dim, ids)
            lm.tensor.index_copy_(lm.block_dim, ids_dev, rows.to(self.device, non_blocking=self.on_device))
        if self.on_device:
            self._stream_of(self.device).synchronize()

    def describe(self) -> str:
        pinned = "pinned " if self.on_device else ""
        return (f"host staging (kv_buffer_device=cpu): {self.nbytes / 2**20:.1f} MiB {pinned}host mirror "
                f"of the {self.device} KV cache")


def make_kv_device(layers: list[LayerMem], kv_buffer_device: str) -> KVDevice:
    """The device policy for these caches: staged if asked, else direct by memory kind."""
    if kv_buffer_device == "cpu":
        return HostStaging(layers)
    if layers and layers[0].kind != "cpu":
        return DirectDeviceKV(layers[0].tensor.device)
    return HostKV()
