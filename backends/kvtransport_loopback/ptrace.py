"""Who may attach to this process for cross-memory attach, under Yama.

``process_vm_readv``/``process_vm_writev`` need the same permission as ``ptrace``
attach on the process whose memory is read or written (the *target*). With the Yama LSM
(``/proc/sys/kernel/yama/ptrace_scope``):

* 0 (or no Yama at all): any process of the same user may; nothing to do.
* 1: only an ancestor, or the one process the target named with
  ``prctl(PR_SET_PTRACER, pid)`` (and that process's descendants). One pid per process.
* 2, 3: only CAP_SYS_PTRACE, or never; cross-process loopback is reported unusable.

Earlier versions called ``prctl(PR_SET_PTRACER, ANY)`` when an agent opened, so every
same-user process could attach to the engine from then on. Now a target names a
ptracer only when a peer asks for it, and names that peer:

1. the initiator of copies (the reader in READ mode, the writer in WRITE mode) sends an
   ``attach`` control message over the authenticated notification transport when it
   connects, carrying its pid, start time and boot id. Only holders of the target's
   metadata can seal one;
2. the target checks that this very process still runs (pid + start time + boot id, so
   a recycled pid is never granted) and, under scope 1 only, sets PR_SET_PTRACER to it;
3. one pid at a time: when several peers copy from one target, a copy that is refused
   with EPERM asks again and retries within its deadline, so a peer that is not the
   current ptracer is re-granted before its copy. Peers copying at the very same time
   take turns per system call; for many concurrent initiators the backend option
   ``ptrace_grant="any"`` restores PR_SET_PTRACER_ANY, set at the first request and
   logged as a warning, because it lets any same-user process attach.

When a granted process exits the kernel drops the relation itself, so a recycled pid
does not inherit it. A metadata holder could name another live process of the same
user; it could already read and write our memory itself, so this grants nothing new.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
from collections.abc import Callable

from kvtransport.process_identity import ProcessIdentity

__all__ = ["Grant", "PtracerPolicy", "PtracerSlot", "PROCESS_SLOT", "set_ptracer", "yama_scope", "GRANT_MODES"]

log = logging.getLogger(__name__)

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
YAMA_PATH = "/proc/sys/kernel/yama/ptrace_scope"
#: Values of the loopback option ``ptrace_grant``.
GRANT_MODES = ("peer", "any")

_libc = ctypes.CDLL(None, use_errno=True)


def yama_scope() -> int | None:
    """The Yama ptrace scope, or None when this kernel has no Yama."""
    try:
        with open(YAMA_PATH) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None


def set_ptracer(pid: int) -> None:
    """``prctl(PR_SET_PTRACER, pid)``; ``PR_SET_PTRACER_ANY`` for any process."""
    if _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PTRACER, {pid}) failed")


class Grant(enum.Enum):
    """What :meth:`PtracerPolicy.on_attach_request` did."""

    NOT_NEEDED = "not needed (no Yama, or ptrace_scope=0: same user suffices)"
    IMPOSSIBLE = "impossible (ptrace_scope >= 2: cross-process loopback is off)"
    REFUSED = "refused (the requesting process is not running, or not checkable here)"
    GRANTED = "granted to the requesting process"
    ALREADY = "already the current ptracer"
    ANY = "granted to any process (ptrace_grant='any')"


class PtracerSlot:
    """The one ptracer a process can name. PR_SET_PTRACER is per process, so every agent
    of a process must share one slot (:data:`PROCESS_SLOT`): an agent that believed it
    had named its peer after another agent of the process named someone else would
    never re-grant it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: ProcessIdentity | None = None  # None: nobody named, or ANY
        self.any_granted = False


#: The slot of this process; tests of the decisions pass a fresh :class:`PtracerSlot`.
PROCESS_SLOT = PtracerSlot()


class PtracerPolicy:
    """Decides which process this one names as its ptracer; thread-safe.

    ``scope`` is the Yama scope read once at open; ``prctl`` names the ptracer (default:
    this module's :func:`set_ptracer`, looked up at call time); ``slot`` is the process's
    ptracer slot, shared by every agent of the process.
    """

    def __init__(self, scope: int | None, mode: str = "peer",
                 prctl: Callable[[int], None] | None = None, slot: PtracerSlot | None = None) -> None:
        if mode not in GRANT_MODES:
            raise ValueError(f"ptrace_grant must be one of {GRANT_MODES}, got {mode!r}")
        self.scope = scope
        self.mode = mode
        self._prctl = prctl
        self.slot = slot or PROCESS_SLOT
        self.grants = 0  # prctl calls made by this policy (this agent)

    @property
    def needs_grant(self) -> bool:
        """Whether a target must name its accessor (scope 1): initiators then ask."""
        return self.scope == 1

    def on_attach_request(self, requester: ProcessIdentity) -> Grant:
        if self.scope is None or self.scope == 0:
            return Grant.NOT_NEEDED
        if self.scope >= 2:
            return Grant.IMPOSSIBLE
        if requester.is_alive() is not True:
            log.warning("loopback: attach request from pid %d refused: %s", requester.pid, Grant.REFUSED.value)
            return Grant.REFUSED
        slot = self.slot
        with slot.lock:
            if self.mode == "any":
                if slot.any_granted:
                    return Grant.ALREADY
                log.warning("loopback: ptrace_grant='any': any process of this user may now attach to this "
                            "process (PR_SET_PTRACER_ANY); use the default 'peer' unless many peers copy at once")
                (self._prctl or set_ptracer)(PR_SET_PTRACER_ANY)
                slot.any_granted, slot.current = True, None
                self.grants += 1
                return Grant.ANY
            if slot.current == requester and not slot.any_granted:
                return Grant.ALREADY
            (self._prctl or set_ptracer)(requester.pid)
            slot.current, slot.any_granted = requester, False
            self.grants += 1
            return Grant.GRANTED
