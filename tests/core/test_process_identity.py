"""kvtransport.process_identity: pid + start time + boot id name one process.

Real processes throughout: our own, children that run, exit (zombie, then reaped), and a
child whose command name holds spaces and parentheses.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtransport.process_identity import ProcessIdentity, ProcessWatch, boot_id, pid_namespace, process_start_time

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")


def _uptime_ticks() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def _waiting_child(executable: str = sys.executable) -> subprocess.Popen:
    """A child that runs until its stdin closes (no sleep: it blocks on a read). Returns once
    the child said it runs: Popen may return before the kernel renamed the child to its new
    executable's name."""
    child = subprocess.Popen([executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "up\n"
    return child


def test_own_process_is_alive() -> None:
    me = ProcessIdentity.current()
    assert me.pid == os.getpid()
    assert me.start_time == process_start_time(os.getpid()) > 0
    assert me.boot_id == boot_id() != ""
    assert me.pid_ns == pid_namespace()
    assert me.is_alive() is True
    # Only the three named fields are needed (what a peer's export carries).
    assert ProcessIdentity(me.pid, me.start_time, me.boot_id).is_alive() is True


def test_running_child_alive_then_zombie_then_reaped_is_false() -> None:
    child = _waiting_child()
    try:
        ident = ProcessIdentity(child.pid, process_start_time(child.pid), boot_id())
        assert ident.is_alive() is True
    finally:
        child.stdin.close()
    # Wait for the exit without reaping: the pid still exists, as a zombie.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    assert process_start_time(child.pid) == ident.start_time  # /proc/PID still there
    assert ident.is_alive() is False
    assert child.wait() == 0
    child.stdout.close()
    assert ident.is_alive() is False
    # Whatever now holds that pid (usually nothing) is not our child.
    assert process_start_time(child.pid) != ident.start_time


def test_forged_start_time_is_false() -> None:
    me = ProcessIdentity.current()
    assert ProcessIdentity(me.pid, me.start_time + 1, me.boot_id).is_alive() is False
    assert ProcessIdentity(me.pid, me.start_time - 1, me.boot_id).is_alive() is False


def test_other_boot_or_namespace_or_unknown_boot_cannot_tell() -> None:
    me = ProcessIdentity.current()
    other_boot = "00000000-0000-0000-0000-000000000000"
    assert other_boot != me.boot_id
    assert ProcessIdentity(me.pid, me.start_time, other_boot).is_alive() is None
    assert ProcessIdentity(me.pid, me.start_time, "").is_alive() is None
    assert ProcessIdentity(me.pid, me.start_time, me.boot_id, "4026531836x").is_alive() is None
    assert not ProcessIdentity(me.pid, me.start_time, other_boot).checkable_here()


def test_gone_pid_has_no_start_time() -> None:
    child = _waiting_child()
    started = process_start_time(child.pid)
    assert started > 0
    child.stdin.close()
    child.wait()
    child.stdout.close()
    # Reaped: gone (-1), or the pid was recycled at once and has another start time.
    assert process_start_time(child.pid) != started
    assert process_start_time(0x7FFFFFFF) == -1  # above pid_max: never exists


def test_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    """The kernel's comm is the executable's base name: start one through a symlink named
    with ") (" and spaces, so a parser splitting at the first ')' or on spaces reads the
    wrong field. The start time must fall between the clock before and after the spawn."""
    tricky = "kv) (t x) y"
    link = tmp_path / tricky
    link.symlink_to(sys.executable)
    before = _uptime_ticks()
    child = _waiting_child(str(link))
    try:
        after = _uptime_ticks()
        with open(f"/proc/{child.pid}/comm") as f:
            assert f.read().rstrip("\n") == tricky  # the name really is the tricky one
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            naive = f.read().split()
        st = process_start_time(child.pid)
        assert math.floor(before) - 1 <= st <= math.ceil(after) + 1
        assert naive[21] != str(st).encode()  # a naive split would have read another field
        ident = ProcessIdentity(child.pid, st, boot_id())
        assert ident.is_alive() is True
    finally:
        child.stdin.close()
        child.wait()
        child.stdout.close()
    assert ident.is_alive() is False


def _open_fds() -> set[str]:
    """This process's open /proc/<pid>/stat files (only those: a descriptor that another
    thread of a long test run opens or closes meanwhile must not change the count)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        parts = target.split("/")
        if len(parts) == 4 and parts[1] == "proc" and parts[2].isdigit() and parts[3] == "stat":
            out.add(fd)
    return out


def test_watch_answers_as_the_identity_does_through_zombie_and_reaping() -> None:
    """ProcessWatch keeps the stat file open (one pread per question): the same answers as
    ProcessIdentity at every stage of a child's life, and the file closes with the watch."""
    before = _open_fds()
    child = _waiting_child()
    try:
        ident = ProcessIdentity(child.pid, process_start_time(child.pid), boot_id())
        with_child = _open_fds()
        watch = ProcessWatch(ident)
        assert len(_open_fds() - with_child) == 1  # exactly the stat file
        assert watch.is_alive() is True and watch.is_alive() is True  # re-read, same answer
    finally:
        child.stdin.close()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped
    assert watch.is_alive() is False and ident.is_alive() is False
    assert child.wait() == 0
    child.stdout.close()
    assert watch.is_alive() is False  # reaped: the open file reads ESRCH
    forged = ProcessWatch(ProcessIdentity(os.getpid(), ProcessIdentity.current().start_time + 1, boot_id()))
    assert forged.is_alive() is False
    del watch, forged  # garbage-collected: their files are closed
    assert _open_fds() <= before


def test_watch_that_cannot_open_the_file_or_was_closed_falls_back_to_the_identity() -> None:
    me = ProcessIdentity.current()
    other_boot = ProcessWatch(ProcessIdentity(me.pid, me.start_time, "00000000-0000-0000-0000-000000000000"))
    assert other_boot.is_alive() is None  # not checkable here: nothing opened, same answer
    gone = ProcessWatch(ProcessIdentity(0x7FFFFFFF, 1, me.boot_id))
    assert gone.is_alive() is False  # no such pid: the open failed, the identity answers
    w = ProcessWatch(me)
    before = _open_fds()
    w.close()
    assert len(before - _open_fds()) == 1  # exactly the stat file was closed
    assert w.is_alive() is True  # answered by reading /proc as before


_LEADER_EXITS_FIRST = """
import ctypes, os, sys, threading
def last_thread():
    sys.stdin.read()  # runs until the test closes our stdin
    os._exit(0)
threading.Thread(target=last_thread).start()
print('up', flush=True)
ctypes.CDLL(None).pthread_exit(None)  # the thread-group leader exits; the process goes on
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def test_process_whose_leader_exited_has_not_exited_while_another_thread_runs() -> None:
    """The stat file describes the thread-group leader only. A leader that exited first (a
    zombie) while another thread still runs -- and might be inside a copy into our memory --
    is "not alive" for the data path (a copy may have met a dying peer) but has not exited:
    has_exited() turns True only once its last thread is gone."""
    child = subprocess.Popen([sys.executable, "-c", _LEADER_EXITS_FIRST], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"
        ident = ProcessIdentity(child.pid, process_start_time(child.pid), boot_id())
        watch = ProcessWatch(ident)
        assert ident.has_exited() is False and watch.has_exited() is False
        end = time.monotonic() + 30  # until the leader's pthread_exit has made it a zombie
        while _state(child.pid) != "Z" and time.monotonic() < end:
            os.sched_yield()
        assert _state(child.pid) == "Z"
        assert ident.is_alive() is False and watch.is_alive() is False
        assert ident.has_exited() is False and watch.has_exited() is False
    finally:
        child.stdin.close()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # the last thread exited: not reaped
    assert ident.has_exited() is True and watch.has_exited() is True
    assert child.wait() == 0
    child.stdout.close()
    assert ident.has_exited() is True and watch.has_exited() is True  # reaped
    forged = ProcessIdentity(os.getpid(), ProcessIdentity.current().start_time + 1, boot_id())
    assert forged.has_exited() is True  # that process is not this one
    assert ProcessIdentity.current().has_exited() is False
