"""kvtransport: move paged KV-cache blocks between LLM serving engines.

Start here::

    import kvtransport as kvt
    a = kvt.open("loopback", name="prefill")
    b = kvt.open("loopback", name="decode")
    ra = a.register(np.zeros(1 << 20, np.uint8))
    rb = b.register(np.zeros(1 << 20, np.uint8))
    peer = b.connect(a.metadata())
    t = b.read(peer, rb.segments([0], [4096]), peer.region(ra.id).segments([0], [4096]))
    assert t.wait().ok

See docs/ARCHITECTURE.md for how the pieces fit.
"""

from . import errors
from .agent import Agent, AgentConfig, Notification, Peer, open_agent
from .faults import FaultPlan
from .memory import MemoryRegion, RemoteMemoryRegion
from .progress_fd import ProgressFd
from .registry import BackendInfo, available_backends, installed_backends
from .segments import BlockLayout, Segments, merge_pairs
from .spi import Op
from .transfer import PreparedTransfer, State, Transfer, TransferOwner, TransferStatus, wait_any

__version__ = "0.1.0"

#: ``kvtransport.open(backend, name=..., **options)`` — see :func:`open_agent`.
open = open_agent  # noqa: A001 - the public name mirrors the builtin on purpose

__all__ = [
    "Agent", "AgentConfig", "BackendInfo", "BlockLayout", "FaultPlan", "MemoryRegion",
    "Notification", "Op", "Peer", "PreparedTransfer", "ProgressFd", "RemoteMemoryRegion", "Segments", "State",
    "Transfer", "TransferOwner", "TransferStatus", "available_backends", "errors",
    "installed_backends", "merge_pairs", "open", "open_agent", "wait_any",
]
