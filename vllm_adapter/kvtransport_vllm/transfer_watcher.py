"""The thread shape shared by the workers' helpers that act the moment a transfer ends.

Why: the engine thread advances loads and holds only between forwards, so what must follow
a transfer's end at once (a WRITE's "written", a READ's confirmation) is done by a thread of
its own that waits on the agent. Each such thread owns its side-channel clients (a DEALER
socket serves one thread), is woken by an event the engine thread sets when it posts, must
never take the engine down (the engine thread still does the same work at its next step),
and is stopped before the agent closes. This class is that shape; a subclass gives
:meth:`_step`, one round of looking and waiting.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from .side_channel import SideChannelClient

log = logging.getLogger(__name__)

__all__ = ["TransferWatcher"]


class TransferWatcher:
    """A daemon thread running :meth:`_step` until :meth:`close`; a subclass sets its own
    state, then calls :meth:`_start` at the end of its constructor."""

    def __init__(self, wake: threading.Event, new_client: Callable[[str, int], SideChannelClient],
                 thread_name: str, fallback: str) -> None:
        self._wake = wake  # set by the engine thread when it posts; cleared by ``_step``
        self._new_client = new_client
        self._clients: dict[tuple[str, int], SideChannelClient] = {}
        self._stop = threading.Event()
        self._fallback = fallback  # what happens instead once the thread has died (logged)
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        """Whether the thread runs (False once closed, or after an error stopped it)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (before the agent closes: it polls the agent's transfers)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def _client_to(self, host: str, port: int) -> SideChannelClient:
        c = self._clients.get((host, port))
        if c is None:
            c = self._clients[(host, port)] = self._new_client(host, port)
        return c

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
        except Exception:  # never take the engine down
            log.exception("kvtransport: thread %s stopped; %s", self._thread.name, self._fallback)

    def _step(self) -> None:
        raise NotImplementedError
