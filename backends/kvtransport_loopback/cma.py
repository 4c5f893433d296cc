"""Linux cross-memory attach: ``process_vm_readv`` / ``process_vm_writev`` via ctypes.

One system call moves up to ``IOV_MAX`` (1024) segments directly between two address
spaces, with no staging copy and no work on the other process. The iovec arrays are
built with numpy (an ``(n, 2)`` uint64 array has exactly the layout of ``struct iovec``
on 64-bit Linux), so the data path has one Python iteration per 1024 segments.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import numpy as np

from .ptrace import yama_scope

__all__ = ["IOV_MAX", "CmaError", "cma_available", "copy_segments"]

IOV_MAX = 1024
#: Bytes one call may move: the kernel moves at most MAX_RW_COUNT (2 GiB - 4 KiB) per
#: call and reports the rest as a short count, which would read as a failed copy. Larger
#: segments are cut, and a call carries at most this many bytes.
MAX_CALL_BYTES = 1 << 30

_libc = ctypes.CDLL(None, use_errno=True)
_ssize_t = ctypes.c_ssize_t
_fns: dict[str, object] = {}
for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name, None)
    if _fn is not None:
        _fn.restype = _ssize_t
        _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                        ctypes.c_ulong, ctypes.c_ulong]
        _fns[_name] = _fn


class CmaError(OSError):
    """A cross-memory copy failed; ``errno`` says why (ESRCH: peer gone, EPERM: refused)."""


def cma_available() -> tuple[bool, str]:
    """Can this process use CMA? Tried on itself; returns (ok, reason if not)."""
    if not sys.platform.startswith("linux"):
        return False, f"cross-memory attach needs Linux (this is {sys.platform})"
    if len(_fns) != 2:
        return False, "libc has no process_vm_readv/process_vm_writev"
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    try:
        copy_segments("read", os.getpid(),
                      np.array([dst.ctypes.data], np.uint64), np.array([src.ctypes.data], np.uint64),
                      np.array([64], np.uint64))
    except CmaError as exc:
        return False, f"the kernel refused process_vm_readv ({exc}); cross-process loopback is off"
    if not np.array_equal(src, dst):
        return False, "process_vm_readv returned wrong bytes"
    scope = yama_scope()
    if scope is not None and scope >= 2:
        return False, (f"kernel.yama.ptrace_scope={scope} forbids attaching to other processes; "
                       "set it to 0 or 1 (sysctl kernel.yama.ptrace_scope=1) for cross-process loopback")
    return True, ""


def copy_segments(op: str, pid: int, local_addr: np.ndarray, remote_addr: np.ndarray,
                  length: np.ndarray, should_stop=None) -> int:
    """Copy segment pairs between this process and ``pid``: ``op="read"`` remote->local,
    ``"write"`` local->remote. Returns bytes moved; raises :class:`CmaError`.

    ``should_stop()`` is checked between system calls, so a cancelled transfer stops
    issuing new copies (what is already in a call completes).
    """
    fn = _fns["process_vm_readv" if op == "read" else "process_vm_writev"]
    cap = MAX_CALL_BYTES
    if int(length.max(initial=0)) > cap:
        local_addr, remote_addr, length = _cut(local_addr, remote_addr, length, cap)
    n = int(length.size)
    liov = np.empty((n, 2), dtype=np.uint64)
    riov = np.empty((n, 2), dtype=np.uint64)
    liov[:, 0] = local_addr
    liov[:, 1] = length
    riov[:, 0] = remote_addr
    riov[:, 1] = length
    lbase = liov.ctypes.data
    rbase = riov.ctypes.data
    ends = np.cumsum(length, dtype=np.uint64)
    moved = 0
    start = 0
    while start < n:
        if should_stop is not None and should_stop():
            raise CmaError(errno.ECANCELED, "transfer cancelled")
        base = int(ends[start - 1]) if start else 0
        # up to IOV_MAX segments and `cap` bytes (every segment is <= cap, so at least one)
        cnt = max(1, min(IOV_MAX, int(np.searchsorted(ends, base + cap, side="right")) - start))
        want = int(ends[start + cnt - 1]) - base
        got = fn(pid, lbase + start * 16, cnt, rbase + start * 16, cnt, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise CmaError(err, f"process_vm_{op}v to pid {pid}: {os.strerror(err)}")
        if got != want:
            # Partial copies happen only when part of a range is unmapped on one side.
            raise CmaError(errno.EFAULT, f"process_vm_{op}v to pid {pid} moved {got} of {want} bytes")
        moved += got
        start += cnt
    return moved


def _cut(local_addr: np.ndarray, remote_addr: np.ndarray, length: np.ndarray, cap: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same byte ranges as segments of at most ``cap`` bytes (vectorised)."""
    length = length.astype(np.uint64)
    pieces = (length + np.uint64(cap - 1)) // np.uint64(cap)
    seg = np.repeat(np.arange(length.size), pieces.astype(np.int64))
    first = np.repeat(np.cumsum(pieces) - pieces, pieces.astype(np.int64))
    off = (np.arange(seg.size, dtype=np.uint64) - first.astype(np.uint64)) * np.uint64(cap)
    ln = np.minimum(np.uint64(cap), length[seg] - off)
    return (local_addr.astype(np.uint64)[seg] + off, remote_addr.astype(np.uint64)[seg] + off, ln)
