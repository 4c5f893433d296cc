"""A file descriptor that becomes readable when an agent's transfers may have changed state.

Why: a thread that must act both when a transfer ends and when a message arrives on a
socket can wait on only one of them with :func:`~kvtransport.wait_any` or the socket's own
poll, and then sees the other late. The vLLM connector's read confirmer is such a thread:
a read ends -> it sends "done with key?"; the answer arrives -> it settles the load. Waiting
on the transfers alone, it noticed answers up to a nap late (measured: 1.6 ms median of a
2.6 ms confirmation at concurrency 8). An fd joins both in one ``select``/``poll``/
``zmq.Poller`` call, the way UCX's worker event fd does.

An ``eventfd`` (Linux): a counter, so signals never pile up as bytes. Protocol, so that no
signal is missed: :meth:`ProgressFd.clear`, then look at the transfers, then wait on the
fd. A signal means "may have changed", never which transfer: look at all of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["ProgressFd"]


class ProgressFd:
    """One waiter's fd, made by :meth:`Agent.open_progress_fd`; :meth:`close` it (or use it
    as a context manager) when done, which also stops the agent signalling it."""

    def __init__(self, unregister: Callable[[ProgressFd], None]) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._unregister = unregister
        self._closed = False

    def fileno(self) -> int:
        """The fd to wait on for readability (``zmq.Poller.register`` and ``select`` take
        this object as it is)."""
        return self._fd

    def signal(self) -> None:
        """Make the fd readable (the agent calls this on every progress signal)."""
        os.eventfd_write(self._fd, 1)

    def clear(self) -> None:
        """Make the fd unreadable until the next signal: call before looking at transfers."""
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Stop being signalled, then close the fd. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unregister(self)  # after this the agent never signals it: closing is safe
        os.close(self._fd)

    def __enter__(self) -> ProgressFd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
