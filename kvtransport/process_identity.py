"""Which process exported some memory, and whether that very process still runs.

A pid alone does not name a process: the kernel recycles pids, so a peer that died may be
"alive" again as an unrelated process. The kernel's start time of the pid (field 22 of
``/proc/PID/stat``, clock ticks since boot) together with the pid does name one process for
the life of a boot, and the boot id says which boot that was. Backends export a
:class:`ProcessIdentity` with their memory so a same-host peer can tell, before it writes, that
the memory's owner is still the process that exported it (loopback's cma path), or learn that
a peer died sooner than a deadline would tell it (ucx over transports without peer-failure
reports).

Linux only; where ``/proc`` cannot be read the answer is "cannot tell" (``None``), never a
guess.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ProcessIdentity", "ProcessWatch", "boot_id", "peer_alive", "pid_namespace", "process_start_time"]

#: ``PF_EXITING`` from include/linux/sched.h: the process is being torn down. Its memory
#: may already be gone although ``/proc/PID`` still exists.
_PF_EXITING = 0x00000004
#: States of a process that will never run again: zombie, dead.
_GONE_STATES = frozenset({"Z", "X", "x"})


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, or None if the pid is gone.

    The command name (field 2, in parentheses) may itself contain spaces and parentheses, so
    the split starts after the *last* ``)``: element 0 is field 3 (state), element ``k`` is
    field ``k + 3``.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return _parse_stat(data)


def _parse_stat(data: bytes) -> list[str] | None:
    """:func:`_stat_fields` of the bytes of one ``/proc/PID/stat`` read."""
    end = data.rfind(b")")
    if end < 0:
        return None
    return data[end + 2:].decode("ascii", "replace").split()


def _other_threads_run(pid: int) -> bool:
    """Whether the thread group of ``pid`` still has a thread besides its leader (the
    ``Threads:`` line of ``/proc/PID/status`` counts every thread not yet released, the
    leader included, zombie or not). False when the file cannot be read (the process was
    reaped)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Threads:"):
                    return int(line.split()[1]) > 1
    except (OSError, ValueError, IndexError):
        return False
    return False


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat); -1 if gone."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else -1
    except (IndexError, ValueError):
        return -1


@functools.cache
def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``); "" where it cannot be read.

    Start times count from boot, so two identities compare only within one boot id.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def pid_namespace() -> str:
    """Inode of our pid namespace ("" if unknown): a pid means the same process only to
    processes of the same namespace (two containers on one kernel share the boot id)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessIdentity:
    """One process of one boot: ``pid`` + kernel ``start_time`` + ``boot_id``.

    ``pid_ns`` (optional, "" = unknown) is the pid namespace the pid is valid in; when it is
    known and differs from ours, :meth:`is_alive` cannot tell and answers None.
    """

    pid: int
    start_time: int
    boot_id: str
    pid_ns: str = ""

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid, process_start_time(pid), boot_id(), pid_namespace())

    def checkable_here(self) -> bool:
        """Whether this identity's pid can be looked up from this process: same boot and
        (when known) same pid namespace."""
        if not self.boot_id or self.boot_id != boot_id():
            return False
        return not self.pid_ns or self.pid_ns == pid_namespace()

    def is_alive(self) -> bool | None:
        """True: that very process still runs. False: it exited, is exiting, or the pid now
        belongs to another process. None: cannot tell here (another boot or host, another
        pid namespace, ``/proc`` unreadable).

        A process counts as gone from the moment the kernel flags its thread-group leader
        ``PF_EXITING``, before its memory is torn down, and as a zombie: so a copy that failed
        because the peer's memory vanished is always followed by ``is_alive() is False``.
        That is the data path's question ("may my copy have met a dying peer?"). Whether the
        peer can still write into *our* memory is :meth:`has_exited`'s.
        """
        if not self.checkable_here():
            return None
        return self._judge(_stat_fields(self.pid))

    def _judge(self, fields: list[str] | None) -> bool | None:
        """:meth:`is_alive` from the fields of one read of our pid's stat file."""
        if fields is None:
            return False
        try:
            state, flags, start = fields[0], int(fields[6]), int(fields[19])
        except (IndexError, ValueError):
            return None
        if start != self.start_time:
            return False  # the pid was recycled (or the identity was never true)
        return state not in _GONE_STATES and not flags & _PF_EXITING

    def has_exited(self) -> bool | None:
        """True: no thread of that process runs any more, so nothing it started can touch
        our memory (reaped, pid recycled, or its leader exited with no other thread left).
        False: some thread of it may still run. None: cannot tell here.

        Why not ``not is_alive()``: the stat file describes the thread-group leader only, and
        the leader can exit first (``pthread_exit``, or first of the threads under SIGKILL)
        while another thread is still inside ``process_vm_writev`` into our memory.
        """
        if not self.checkable_here():
            return None
        return self._judge_exit(_stat_fields(self.pid))

    def _judge_exit(self, fields: list[str] | None) -> bool | None:
        """:meth:`has_exited` from the fields of one read of our pid's stat file."""
        alive = self._judge(fields)
        if alive is None or alive:
            return None if alive is None else False
        if fields is None or int(fields[19]) != self.start_time:
            return True  # reaped, or the pid now names another process
        # the leader is a zombie or exiting: exited once its other threads are gone too
        return not _other_threads_run(self.pid)


class ProcessWatch:
    """Asks :meth:`ProcessIdentity.is_alive` of one identity again and again, cheaply.

    Why: backends ask after every transfer to a same-host peer (a cma copy into a peer that
    died must never read as DONE), and opening, reading and closing ``/proc/PID/stat`` took
    ~14 us here, a fifth of a 1 MiB shared-memory READ. The watch keeps the file open and
    re-reads it with one ``pread`` (~3 us), with the same answers: the open file stays bound
    to the process it was opened for, so once that process is reaped the read fails (ESRCH)
    and a recycled pid reads as gone even before the start time is compared. Where the file
    cannot be opened (another boot or namespace, ``/proc`` unreadable, the process already
    gone) every call falls back to :meth:`ProcessIdentity.is_alive`. The file is closed by
    :meth:`close`, or when the watch is garbage-collected, so a dropped peer leaks nothing.
    """

    def __init__(self, ident: ProcessIdentity) -> None:
        self.ident = ident
        self._fd = -1
        if ident.checkable_here():
            try:
                self._fd = os.open(f"/proc/{ident.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass  # answered by ProcessIdentity.is_alive each time
        self._closer = weakref.finalize(self, os.close, self._fd) if self._fd >= 0 else None

    @staticmethod
    def _fields(fd: int) -> list[str] | None:
        """The stat fields re-read from the open file; None once the process we opened it
        for was reaped (ESRCH), which both judges read as gone."""
        try:
            return _parse_stat(os.pread(fd, 4096, 0))
        except OSError:
            return None

    def is_alive(self) -> bool | None:
        """:meth:`ProcessIdentity.is_alive`, answered from the open file."""
        fd = self._fd
        return self.ident.is_alive() if fd < 0 else self.ident._judge(self._fields(fd))

    def has_exited(self) -> bool | None:
        """:meth:`ProcessIdentity.has_exited`, the stat part answered from the open file."""
        fd = self._fd
        return self.ident.has_exited() if fd < 0 else self.ident._judge_exit(self._fields(fd))

    def close(self) -> None:
        """Close the file (later calls fall back to reading ``/proc`` each time). Not while
        another thread may be asking: its read could meet a reused descriptor."""
        self._fd = -1
        if self._closer is not None:
            self._closer()


class _ExitCheck(Protocol):
    def has_exited(self) -> bool | None: ...


def peer_alive(watch: _ExitCheck | None, otherwise: Callable[[], bool | None] = lambda: None) -> bool | None:
    """The answer to ``Backend.peer_alive`` for a peer whose process ``watch`` names.

    ``watch`` (a :class:`ProcessIdentity` or :class:`ProcessWatch`; None when the backend
    does not check this peer's process, e.g. another host or our own process) decides when
    it can: gone means every thread of the peer gone (:meth:`ProcessIdentity.has_exited`),
    not only its main one, since a thread may still be copying into our memory. When it
    cannot tell, ``otherwise()`` answers: what the backend knows by other means (its
    transport reported the peer dead, or the pid check its data path uses)."""
    exited = watch.has_exited() if watch is not None else None
    return otherwise() if exited is None else not exited
