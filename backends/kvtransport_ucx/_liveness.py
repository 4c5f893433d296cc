"""Identity of a process, and whether a same-host peer process is still alive.

UCX only reports a dead peer on endpoints opened with ``UCP_ERR_HANDLING_MODE_PEER``, and
the shared-memory transports (sysv, posix) do not support that mode. For a peer on the same
host we can do better than waiting for the deadline: the peer exports its pid together with
the kernel's start time of that pid, the boot id and its pid namespace. If the pid is gone, or
now belongs to a process that started at another time (pid reuse), the peer is dead.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


_PF_EXITING = 0x00000004  # include/linux/sched.h: "getting shut down"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot); -1 if the pid does not exist."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return -1
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return -1


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int
    boot_id: str
    pid_ns: str
    hostname: str

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid, _start_time(pid), _read("/proc/sys/kernel/random/boot_id"), _pid_namespace(),
                   socket.gethostname())

    def same_host_as(self, other: ProcessIdentity) -> bool:
        """True when ``other``'s pid can be checked from here (same kernel, same pid namespace)."""
        return bool(self.boot_id) and self.boot_id == other.boot_id and self.pid_ns == other.pid_ns

    def is_alive(self) -> bool:
        """Only meaningful for a same-host identity: is that exact process still running?

        A process that is exiting counts as dead from the moment the kernel flags it
        ``PF_EXITING`` — before its memory is torn down — so a cma copy that failed because
        the peer's memory vanished is always followed by ``is_alive() == False``.
        """
        stat = _read(f"/proc/{self.pid}/stat")
        if not stat:
            return False
        rest = stat[stat.rfind(")") + 2 :].split()
        try:
            state, flags, start = rest[0], int(rest[6]), int(rest[19])
        except (IndexError, ValueError):
            return False
        if state in ("Z", "X", "x") or flags & _PF_EXITING:
            return False
        return start == self.start_time
