"""Non-blocking batch status through Mooncake's C++ API (ctypes on ``mooncake/engine.so``).

Why not the Python binding: its only non-blocking check, ``transfer_check_status(batch)``,
looks at task 0 of a batch alone (a scattered READ of 512 segments would be reported done
when its first segment is), and ``get_batch_transfer_status([batch])`` blocks, spinning a
core, until every batch ends or Mooncake's own 30 s timeout. Neither fits ``Backend.poll``.
The C++ ``mooncake::TransferEngine`` methods below are exported by ``engine.so`` and take
the engine pointer the binding gives out (``TransferEngine.get_engine_ptr()``):

* ``Status getBatchTransferStatus(BatchID, TransferStatus&)`` — COMPLETED when every task
  completed; FAILED as soon as *one* task failed, although other tasks may still be moving;
* ``Status getTransferStatus(BatchID, size_t task, TransferStatus&)`` — one task; marks the
  task finished when all its slices ended, which ``freeBatchID`` requires;
* ``Status freeBatchID(BatchID)`` — refuses (``kBatchBusy``) while any task is unfinished.

ABI (Itanium, x86-64): ``mooncake::Status`` has a user-provided destructor, so it is
returned through a hidden pointer passed before ``this``; it is ``{uint16 code; const char*
message}``. ``TransferStatus`` is ``{enum s; size_t transferred_bytes}``. Messages are only
set on errors we never trigger (task index out of range, busy batch); a set message is
leaked rather than freed with the wrong allocator. ``check()`` verifies the symbols exist,
so a build that renamed them is reported by ``probe`` instead of crashing.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_uint16, c_uint64, c_void_p

__all__ = ["TaskState", "EngineStatus", "check", "SYMBOLS"]


class TaskState(enum.IntEnum):
    """``mooncake::Transport::TransferStatusEnum``."""

    WAITING = 0
    PENDING = 1
    INVALID = 2
    CANCELED = 3
    COMPLETED = 4
    TIMEOUT = 5
    FAILED = 6


class _TransferStatus(Structure):
    _fields_ = [("s", c_int), ("transferred_bytes", c_size_t)]


class _Status(Structure):
    _fields_ = [("code", c_uint16), ("message", c_void_p)]


SYMBOLS = {
    "batch_status": "_ZN8mooncake14TransferEngine22getBatchTransferStatusEmRNS_9Transport14TransferStatusE",
    "task_status": "_ZN8mooncake14TransferEngine17getTransferStatusEmmRNS_9Transport14TransferStatusE",
    "free_batch": "_ZN8mooncake14TransferEngine11freeBatchIDEm",
}


@functools.cache
def _lib() -> ctypes.CDLL:
    import mooncake.engine as me  # already loaded by the caller: dlopen returns that copy

    lib = ctypes.CDLL(me.__file__)
    ts, st = POINTER(_TransferStatus), POINTER(_Status)
    f = getattr(lib, SYMBOLS["batch_status"])
    f.argtypes, f.restype = [st, c_void_p, c_uint64, ts], c_void_p
    f = getattr(lib, SYMBOLS["task_status"])
    f.argtypes, f.restype = [st, c_void_p, c_uint64, c_uint64, ts], c_void_p
    f = getattr(lib, SYMBOLS["free_batch"])
    f.argtypes, f.restype = [st, c_void_p, c_uint64], c_void_p
    return lib


def check() -> str:
    """"" when the C++ entry points this backend needs are present, else why not."""
    try:
        _lib()
    except (OSError, AttributeError, ImportError) as exc:
        return f"mooncake/engine.so lacks the C++ entry points this backend polls with ({exc})"
    return ""


class EngineStatus:
    """Status calls on one engine (``ptr`` = ``TransferEngine.get_engine_ptr()``)."""

    def __init__(self, ptr: int) -> None:
        lib = _lib()
        self._ptr = c_void_p(ptr)
        self._batch = getattr(lib, SYMBOLS["batch_status"])
        self._task = getattr(lib, SYMBOLS["task_status"])
        self._free = getattr(lib, SYMBOLS["free_batch"])
        self._ts, self._st = _TransferStatus(), _Status()

    def batch(self, batch_id: int) -> TaskState:
        """Whole-batch state: COMPLETED, FAILED (some task failed) or WAITING."""
        self._batch(byref(self._st), self._ptr, batch_id, byref(self._ts))
        return TaskState(self._ts.s)

    def unfinished_tasks(self, batch_id: int, ntasks: int) -> int:
        """How many of the batch's tasks may still move bytes (0: the batch is quiescent).
        Marks finished tasks as such, which :meth:`free` needs."""
        busy = 0
        for task in range(ntasks):
            self._task(byref(self._st), self._ptr, batch_id, task, byref(self._ts))
            if self._st.code != 0 or self._ts.s not in (TaskState.COMPLETED, TaskState.FAILED):
                busy += 1
        return busy

    def free(self, batch_id: int) -> bool:
        """Free a batch whose tasks all finished; False (nothing freed) while one still runs."""
        self._free(byref(self._st), self._ptr, batch_id)
        return self._st.code == 0
