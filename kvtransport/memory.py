"""Memory regions: what ``Agent.register`` accepts and what peers see.

Accepted buffers: numpy arrays, torch tensors (duck-typed: no torch import here), any
writable object with the buffer protocol, and raw ``(address, length)`` pairs. The
region keeps a reference to the buffer so it cannot be garbage-collected while
registered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidSegmentsError
from .segments import Segments

__all__ = ["MemoryRegion", "RemoteMemoryRegion", "describe_buffer", "tensor_memory_kind"]


@dataclass(frozen=True)
class MemoryRegion:
    """A region registered on the local agent. Release it with ``agent.deregister``."""

    id: int
    addr: int
    length: int
    kind: str = "cpu"
    device: int = -1
    owner: Any = field(default=None, repr=False, compare=False)

    def segments(self, offsets: Any, lengths: Any) -> Segments:
        return Segments(self.id, offsets, lengths)

    def whole(self) -> Segments:
        return Segments(self.id, 0, self.length)


@dataclass(frozen=True)
class RemoteMemoryRegion:
    """A region a connected peer exported. ``id`` is the peer's region id."""

    id: int
    addr: int
    length: int
    kind: str

    def segments(self, offsets: Any, lengths: Any) -> Segments:
        return Segments(self.id, offsets, lengths)

    def whole(self) -> Segments:
        return Segments(self.id, 0, self.length)


def tensor_memory_kind(tensor: Any) -> tuple[str, int]:
    """``(kind, device index)`` of a torch tensor (or anything with ``.device.type/.index``).

    ROCm builds of torch report AMD GPUs as device type "cuda"; ``torch.version.hip`` tells
    them apart, so such memory is "rocm". CPU memory has device -1."""
    dev = tensor.device
    if dev.type == "cpu":
        return "cpu", -1
    if dev.type == "cuda":
        import torch  # only reached for GPU tensors, so torch is importable

        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return kind, int(dev.index or 0)
    return str(dev.type), int(dev.index or 0)


def describe_buffer(buf: Any, kind: str | None = None, device: int | None = None
                    ) -> tuple[int, int, str, int, Any]:
    """Return ``(addr, length, kind, device, owner)`` for a registrable buffer.

    Raises :class:`InvalidSegmentsError` for what cannot be registered safely
    (non-contiguous or read-only memory, empty buffers, negative addresses).
    """
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(v, int) for v in buf):
        addr, length = buf
        if addr <= 0 or length <= 0:
            raise InvalidSegmentsError(
                f"raw region (address={addr}, length={length}) needs a positive address and length"
            )
        mkind = kind or "cpu"
        if mkind != "cpu" and (device is None or device < 0):
            raise InvalidSegmentsError(
                f"raw {mkind!r} region needs its device index: register((addr, len), kind={mkind!r}, device=N)"
            )
        return addr, length, mkind, -1 if device is None else int(device), None
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor
        if not buf.is_contiguous():
            raise InvalidSegmentsError(
                "tensor is not contiguous; register tensor.contiguous() or its storage"
            )
        length = int(buf.numel()) * int(buf.element_size())
        if length == 0:
            raise InvalidSegmentsError("cannot register an empty tensor")
        tkind, device = tensor_memory_kind(buf)
        return int(buf.data_ptr()), length, kind or tkind, device, buf
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except TypeError as exc:
            raise InvalidSegmentsError(
                f"cannot register {type(buf).__name__}: pass a numpy array, a torch tensor, a "
                "writable buffer, or an (address, length) tuple"
            ) from exc
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidSegmentsError(
            "array is not contiguous; register np.ascontiguousarray(a) or the base array"
        )
    if not arr.flags.writeable:
        raise InvalidSegmentsError("buffer is read-only; transfers may write into it")
    if arr.nbytes == 0:
        raise InvalidSegmentsError("cannot register an empty buffer")
    return int(arr.ctypes.data), int(arr.nbytes), kind or "cpu", -1, buf

