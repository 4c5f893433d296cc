"""Fences: completion of copies already enqueued, polled without blocking.

The worker reports a staged load only once its copy into the device cache is done
(:meth:`.staging.KVDevice.after_receive` returns a fence it polls each step), and a
pinned scratch slot (:class:`.host_mirror.PinnedSlots`) is reused only once the copies
that used it are done. A device's fence is a CUDA event on the copy stream; the host's
is set by the thread that did the work.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Fence", "HostFence", "DeviceFence"]


class Fence(Protocol):
    """Completion of copies already enqueued: ``query`` never blocks, ``synchronize`` does."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class HostFence:
    """The host implementation: work done by a host thread, ready once that thread says so
    (a CPU engine's copies are synchronous, so its fences are ready when returned)."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class DeviceFence:
    """A CUDA event recorded on ``stream`` after the copies it guards; ``keep`` holds the
    host buffers those copies read until the event has completed."""

    def __init__(self, stream: Any, keep: Sequence[Any] = ()) -> None:
        import torch

        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._keep: Sequence[Any] = keep

    def query(self) -> bool:
        if self._event.query():
            self._keep = ()
            return True
        return False

    def synchronize(self) -> None:
        self._event.synchronize()
        self._keep = ()
