"""The backend SPI: the small interface a transport implements.

Thin backends, thick core. A backend only moves bytes and reports what happened;
everything that must hold for *every* backend lives in the core (``kvtransport.agent``):

* validation (every byte of every segment inside a registered region, lengths match,
  peer known, agent open) happens before :meth:`Backend.post` is ever called, so a
  backend may trust every :class:`PostRequest` it receives;
* deadlines: the core polls and fails a transfer whose deadline passed even when the
  backend stays silent, then asks the backend to :meth:`Backend.cancel` it;
* exactly-once completion, metrics and fault injection.

A backend is a class registered under the entry-point group ``kvtransport.backends``::

    [project.entry-points."kvtransport.backends"]
    mybackend = "my_package.backend:MyBackend"

The core never imports a backend module by name; see ``docs/BACKENDS.md``.

Threading: the core serialises calls into one backend instance with a lock, except
:meth:`Backend.probe` (a classmethod). A backend may run its own progress thread.
"""

from __future__ import annotations

import abc
import enum
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "SPI_VERSION",
    "Op",
    "Scope",
    "Capabilities",
    "Availability",
    "LocalRegion",
    "RemoteRegion",
    "PostRequest",
    "PollState",
    "PollResult",
    "Backend",
    "usable_cpus",
]

#: Bumped when the SPI changes incompatibly. Backends may check it in ``probe``.
SPI_VERSION = 1


def usable_cpus() -> int:
    """How many CPUs the calling thread may run on (its affinity mask; at least 1).

    Backends size their copy threads / lanes by it rather than by ``os.cpu_count()``: an
    engine pinned to one core (vLLM on CPU with ``VLLM_CPU_OMP_THREADS_BIND``) starts every
    thread it creates later, ours included, on that core, where a second copy thread cannot
    copy in parallel and only adds hand-offs between threads (measured in docs/UCX.md).
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux: no affinity masks
        return max(1, os.cpu_count() or 1)


class Op(enum.IntEnum):
    """Direction of a one-sided transfer, seen from the initiating agent."""

    READ = 0  # remote -> local (consumer pulls)
    WRITE = 1  # local -> remote (producer pushes)


class Scope(str, enum.Enum):
    """Where a peer may live relative to this agent."""

    SAME_PROCESS = "same_process"
    SAME_HOST = "same_host"
    CROSS_HOST = "cross_host"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the core refuses what a backend does not declare.

    Memory kinds are two capabilities, because the two sides of a transfer are two
    questions. ``memory_kinds`` is what *this* agent can register (its own memory, which
    its transport touches). ``remote_memory_kinds`` is what a peer may export for this
    agent to read or write: a backend whose bytes cross through the peer's own transport
    (UCX, NIXL, Mooncake: the peer's side handles its device memory) can pair a CPU-only
    host with a GPU engine, while one that copies both sides on the CPU (loopback's
    ``process_vm_*``/``memmove``) cannot take a peer's device memory at all. Left unset,
    ``remote_memory_kinds`` is ``memory_kinds``: a backend that never thought about it
    accepts no more from peers than it registers itself.
    """

    read: bool = True
    write: bool = True
    notify: bool = True
    #: Memory kinds accepted by ``register`` (this agent's own memory): "cpu", "cuda", "rocm".
    memory_kinds: frozenset[str] = frozenset({"cpu"})
    scopes: frozenset[Scope] = frozenset({Scope.SAME_PROCESS, Scope.SAME_HOST})
    #: Whether the backend notices a dead peer by itself (transfers fail before the deadline).
    detects_peer_failure: bool = False
    #: Memory kinds a connected peer's regions may be (refused at ``connect`` otherwise).
    #: None (the default) means the same as ``memory_kinds``.
    remote_memory_kinds: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.remote_memory_kinds is None:
            object.__setattr__(self, "remote_memory_kinds", self.memory_kinds)


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not why and how to fix it."""

    usable: bool
    reason: str = ""
    install_hint: str = ""


@dataclass(frozen=True)
class LocalRegion:
    """A region registered on this agent, as the core hands it to the backend.

    ``id`` is unique within the agent and is what :class:`PostRequest` refers to.
    """

    id: int
    addr: int
    length: int
    kind: str = "cpu"
    device: int = -1


@dataclass(frozen=True)
class RemoteRegion:
    """A region exported by a peer: its address range plus the backend's blob for it
    (e.g. a packed UCX remote key, a mori ``MemoryDesc``)."""

    id: int
    addr: int
    length: int
    kind: str
    blob: bytes


@dataclass(slots=True, eq=False)
class PostRequest:
    """One validated, merged batch of segments to move in one direction.

    All arrays have the same length (one entry per merged segment) and are
    read-only. Addresses are absolute (``region.addr + offset``); offsets are
    relative to the region start, for backends (like mori) that address by
    region + offset. ``length`` entries are > 0.

    A backend must not change it. It is not a frozen dataclass because one is built per
    post, and a frozen one's ``__init__`` costs twice a slotted one's (measured 7 vs 3 µs
    right after a 16 MiB copy has evicted the caches).
    """

    op: Op
    transfer_id: int
    peer: Any  # the object this backend returned from ``connect``
    peer_name: str
    local_region: np.ndarray  # int64 region ids
    local_offset: np.ndarray  # uint64
    local_addr: np.ndarray  # uint64
    remote_region: np.ndarray  # int64 region ids (the peer's ids)
    remote_offset: np.ndarray  # uint64
    remote_addr: np.ndarray  # uint64
    length: np.ndarray  # uint64
    notify: bytes | None = None
    #: Monotonic-clock deadline; the core enforces it, a backend may use it as a hint.
    deadline: float = float("inf")

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


class PollState(enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class PollResult:
    """What the backend knows about one posted transfer.

    ``quiesced`` matters only for FAILED: True when the backend guarantees that no
    more bytes of this transfer can land (so the memory may be reused).

    ``will_signal`` matters only for PENDING: True when the backend promises to call
    :meth:`Backend.signal_progress` as soon as this transfer's state can next change (e.g.
    its copy runs on a backend thread that signals when it returns). ``Transfer.wait()``
    then sleeps until that signal instead of waking on its back-off to poll: on a host
    where the waiting thread shares a core with the copy, those wake-ups cost the copy
    ~4 % (measured, 256 MiB over NIXL). A backend that breaks the promise costs a waiter
    at most ``transfer.SIGNALLED_WAIT_CAP_S`` per transfer, never a stranded transfer.
    """

    state: PollState
    reason: str = ""
    quiesced: bool = True
    will_signal: bool = False

    @classmethod
    def pending(cls, will_signal: bool = False) -> PollResult:
        return _PENDING_SIGNALLED if will_signal else _PENDING

    @classmethod
    def done(cls) -> PollResult:
        return _DONE

    @classmethod
    def failed(cls, reason: str, quiesced: bool = True) -> PollResult:
        return cls(PollState.FAILED, reason, quiesced)


_PENDING = PollResult(PollState.PENDING)
_PENDING_SIGNALLED = PollResult(PollState.PENDING, will_signal=True)
_DONE = PollResult(PollState.DONE)


class Backend(abc.ABC):
    """Base class of every transport. Subclasses set ``name`` and ``capabilities``.

    Constructed by the core as ``Backend(agent_name, options)`` where ``options`` is the
    ``**options`` mapping given to :func:`kvtransport.open` minus the core's own keys.
    A backend must reject unknown options with ``kvtransport.errors.BackendOptionError``.
    """

    name: ClassVar[str] = ""
    #: Backend wire/blob version; peers with another version are refused by the core.
    version: ClassVar[str] = "1"
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Option sets the conformance suite runs this backend with (e.g. one per transport).
    conformance_options: ClassVar[tuple[Mapping[str, Any], ...]] = ({},)

    @classmethod
    def probe(cls) -> Availability:
        """Can this backend run here? Must be cheap and must not raise."""
        return Availability(True)

    #: Set by the core. A backend calls :meth:`signal_progress` (from any thread) when a
    #: posted transfer may have changed state, so waiters wake at once instead of at
    #: their next poll. Optional: without it the core polls with a short back-off. A
    #: backend that answers ``PollResult.pending(will_signal=True)`` must call it.
    progress_callback: Callable[[], None] | None = None

    def __init__(self, agent_name: str, options: Mapping[str, Any]) -> None:
        self.agent_name = agent_name
        self.options = dict(options)

    def signal_progress(self) -> None:
        cb = self.progress_callback
        if cb is not None:
            cb()

    # -- memory ---------------------------------------------------------------
    @abc.abstractmethod
    def register(self, region: LocalRegion) -> bytes:
        """Make ``region`` accessible to peers; return the blob peers need for it."""

    @abc.abstractmethod
    def deregister(self, region: LocalRegion) -> None:
        """Undo ``register``. The core calls it only when no transfer uses the region."""

    # -- peers ----------------------------------------------------------------
    @abc.abstractmethod
    def export(self) -> bytes:
        """Agent-level blob peers need to reach this agent (address, pid, ...)."""

    @abc.abstractmethod
    def connect(self, peer_name: str, blob: bytes, regions: Sequence[RemoteRegion]) -> Any:
        """Open a connection to a peer. May be called again for the same ``peer_name``
        (peer re-exported or restarted): the new call replaces the old connection.
        Raise ``kvtransport.errors.PeerMetadataError`` on a blob it cannot use."""

    def disconnect(self, peer: Any) -> None:
        """Forget a peer. Pending transfers to it must end (FAILED, quiesced if possible)."""

    def peer_alive(self, peer: Any) -> bool | None:
        """Is the peer's process alive (True), known gone so that nothing it posted can
        land any more (False), or unknown (None, the default)? Lets owners of memory a
        dead peer was writing into reuse it without waiting for a lease to lapse. "Gone"
        means every thread of it: a process whose main thread exited first may still have
        a thread inside a copy (``ProcessIdentity.has_exited``)."""
        return None

    # -- data path ------------------------------------------------------------
    @abc.abstractmethod
    def post(self, req: PostRequest) -> Any:
        """Start moving ``req``; return a handle for ``poll``. Must not block on the
        transfer itself. Raise any exception to fail the transfer at once."""

    @abc.abstractmethod
    def poll(self, handle: Any) -> PollResult:
        """Report the state of a posted transfer; must not block."""

    def cancel(self, handle: Any) -> bool:
        """Stop a transfer the core has failed (deadline, peer failure). Return True
        when no more bytes of it can land; False if that cannot be promised yet
        (the core then keeps polling ``quiesce`` until it is)."""
        return False

    def quiesced(self, handle: Any) -> bool:
        """After a False ``cancel``: can the backend now promise nothing more lands?

        The default trusts ``poll``: a transfer still PENDING, or FAILED with
        ``quiesced=False``, may still land bytes; a backend that knows better overrides."""
        r = self.poll(handle)
        return r.state is not PollState.PENDING and (r.state is not PollState.FAILED or r.quiesced)

    def release(self, handle: Any) -> None:
        """The core is done with ``handle``; free backend resources."""

    # -- notifications --------------------------------------------------------
    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """Return and forget ``(peer_name, payload)`` messages received so far."""

    def send_notification(self, peer: Any, payload: bytes) -> None:
        """Send a standalone message to a connected peer (no data).

        Raise on failure; the core turns ``NotImplementedError`` (this default) into
        ``kvtransport.errors.UnsupportedOperationError`` and anything else into
        ``kvtransport.errors.NotificationError`` naming the peer and the fix, so callers
        only ever see typed errors. Raising ``NotificationError`` directly is fine."""
        raise NotImplementedError(f"backend {self.name!r} cannot send standalone notifications")

    # -- lifetime -------------------------------------------------------------
    @abc.abstractmethod
    def close(self) -> None:
        """Release everything. Pending transfers end FAILED."""

    # -- introspection --------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Free-form facts for ``kvtransport backends`` and logs (transport in use, ...)."""
        return {}

