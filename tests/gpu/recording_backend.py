"""A test-only backend that RECORDS what the core hands it and never touches memory.

It declares "cpu", "cuda" and "rocm" memory so device-kind regions (which cannot exist on
this GPU-less machine) get past the core's memory-kind gate. Every transfer completes
without a byte moving: it checks only what the core passes to a backend (kinds, devices,
addresses), never a data path. Reached by patching the core's backend lookup
(:func:`open_recording`), not through an entry point.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtransport import agent as agent_mod
from kvtransport.spi import (Backend, Capabilities, LocalRegion, PollResult, PostRequest,
                             RemoteRegion, Scope)

NAME = "recording-test"


class RecordingBackend(Backend):
    name = NAME
    version = "1"
    capabilities = Capabilities(
        read=True, write=True, notify=False,
        memory_kinds=frozenset({"cpu", "cuda", "rocm"}),
        scopes=frozenset({Scope.SAME_PROCESS}),
    )

    def __init__(self, agent_name: str, options: Any) -> None:
        super().__init__(agent_name, options)
        self.registered: list[LocalRegion] = []
        self.connected: list[RemoteRegion] = []
        self.posted: list[PostRequest] = []

    def register(self, region: LocalRegion) -> bytes:
        self.registered.append(region)
        return b""

    def deregister(self, region: LocalRegion) -> None:
        pass

    def export(self) -> bytes:
        return b""

    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Any:
        self.connected.extend(regions)
        return peer_name

    def post(self, req: PostRequest) -> Any:
        self.posted.append(req)
        return len(self.posted)

    def poll(self, handle: Any) -> PollResult:
        return PollResult.done()

    def notifications(self) -> list[tuple[str, bytes]]:
        return []

    def close(self) -> None:
        pass


def install(monkeypatch: Any) -> None:
    """Make ``kvt.open("recording-test")`` build a RecordingBackend (other names unchanged)."""
    real = agent_mod.load_backend_class
    monkeypatch.setattr(agent_mod, "load_backend_class",
                        lambda name: RecordingBackend if name == NAME else real(name))
