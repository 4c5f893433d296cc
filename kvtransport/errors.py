"""Typed errors. Each names the problem and, where there is one, the fix.

Every error raised by kvtransport derives from :class:`KVTransportError`, and the
input-validation ones also derive from the builtin a caller would expect
(``ValueError``, ``LookupError``) so generic handlers keep working.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVTransportError(Exception):
    """Base of every kvtransport error."""


class BackendNotFoundError(KVTransportError, LookupError):
    """No backend of that name is installed."""

    def __init__(self, name: str, installed: Iterable[str]):
        self.name = name
        self.installed = sorted(installed)
        listing = ", ".join(self.installed) or "(none)"
        super().__init__(
            f"unknown kvtransport backend {name!r}; installed backends: {listing}. "
            "A third-party backend is installed by a package declaring an entry point in the "
            "'kvtransport.backends' group (see docs/BACKENDS.md)."
        )


class BackendUnavailableError(KVTransportError, RuntimeError):
    """The backend is installed but cannot run here (missing library, no device)."""

    def __init__(self, name: str, reason: str, install_hint: str = ""):
        self.name = name
        self.reason = reason
        self.install_hint = install_hint
        msg = f"kvtransport backend {name!r} cannot run here: {reason}"
        if install_hint:
            msg += f" (fix: {install_hint})"
        super().__init__(msg)


class BackendOptionError(KVTransportError, ValueError):
    """An option given to ``kvtransport.open`` is unknown or invalid for that backend."""


class InvalidSegmentsError(KVTransportError, ValueError):
    """Segment lists are malformed: lengths differ, out of range, non-positive length."""


class UnsupportedMemoryKindError(InvalidSegmentsError):
    """The backend cannot move this kind of memory ("cuda", "rocm", ...).

    Raised at ``register`` (and at ``connect`` for a peer's region) before any byte moves.
    ``alternatives`` names the installed backends whose declared capabilities accept the
    kind, so the message says what to switch to instead of only what failed."""

    def __init__(self, backend: str, kind: str, accepted: list[str], alternatives: list[str],
                 where: str = "register") -> None:
        self.backend, self.kind, self.accepted, self.alternatives = backend, kind, accepted, alternatives
        others = (f"installed backends that can move {kind!r} memory: {alternatives}; open the agent "
                  "on one of them" if alternatives else
                  f"no installed backend declares {kind!r} memory; install one that does")
        super().__init__(f"backend {backend!r} cannot {where} {kind!r} memory (it accepts {accepted}); "
                         f"{others}")


class UnregisteredMemoryError(KVTransportError, ValueError):
    """A segment refers to a region id that is not registered (locally or on the peer)."""


class UnknownPeerError(KVTransportError, LookupError):
    """The peer is not connected to this agent (never connected, disconnected, or replaced)."""


class PeerMetadataError(KVTransportError, ValueError):
    """Peer metadata is malformed, truncated, oversized or of a foreign protocol version."""


class IncompatiblePeerError(KVTransportError, ValueError):
    """Peer metadata is well-formed but cannot be used: other backend or backend version."""


class LayoutMismatchError(IncompatiblePeerError):
    """The peer's declared KV layout differs from ours (block size, dtype, layers, bytes)."""


class AgentClosedError(KVTransportError, RuntimeError):
    """The agent was closed; open a new one with ``kvtransport.open``."""

    def __init__(self, name: str):
        super().__init__(f"agent {name!r} is closed; open a new one with kvtransport.open()")


class TransferFailedError(KVTransportError, RuntimeError):
    """Raised by ``Transfer.result()`` when the transfer ended FAILED."""


class NotificationError(KVTransportError, ConnectionError):
    """A standalone notification could not be delivered to the peer (peer gone, link
    down, queue full). Also a ``ConnectionError``, so handlers written for the untyped
    error the backends raised before keep working."""


class UnsupportedOperationError(KVTransportError, NotImplementedError):
    """The backend does not implement the operation (e.g. standalone notifications)."""


class StalePreparedTransferError(KVTransportError, LookupError):
    """A ``PreparedTransfer`` no longer matches the agent: its peer was replaced or
    disconnected, a local region it uses was deregistered, or another agent prepared it.
    Call ``Agent.prepare`` again."""
