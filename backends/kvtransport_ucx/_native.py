"""The compiled posting path (``_post.c``) and the choice between it and the ctypes loop.

``_post.c`` is built at install time as an optional setuptools extension (pyproject.toml,
``[tool.setuptools] ext-modules``): where no C compiler is available the install still
succeeds and the backend posts from Python. It is a plain shared library loaded with
ctypes (it does not include Python.h), and it calls ``ucp_put_nbx`` / ``ucp_get_nbx``
through function pointers taken from the libucp the backend already loaded, so it works
with the wheel's UCX and with a system UCX alike.

Which path posts: option ``post`` of ``kvt.open("ucx", ...)``, else the environment
variable ``KVT_UCX_POST``, else ``"auto"``: ``"native"`` (the compiled library; an error
naming the fix if it was not built), ``"ctypes"`` (one ctypes call per segment from
Python, the fallback) or ``"auto"`` (native when built, ctypes otherwise).
``describe()["post_path"]`` says which one an agent uses.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import itertools
import os
import time
from ctypes import POINTER, byref, c_int64, c_uint64, c_void_p
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.errors import BackendOptionError

ENV = "KVT_UCX_POST"
MODES = ("auto", "native", "ctypes")
_HERE = Path(__file__).resolve().parent
_state: dict[str, object] = {}


def _find() -> Path | None:
    """The built library next to this module (``_post`` + an extension-module suffix)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = _HERE / f"_post{suffix}"
        if p.is_file():
            return p
    return None


def library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, why not). Loaded once per process."""
    if "lib" not in _state:
        path = _find()
        if path is None:
            _state["lib"], _state["why"] = None, (
                f"the compiled posting library (kvtransport_ucx/_post.c) was not built in {_HERE}: "
                "reinstall with a C compiler present (e.g. apt-get install gcc; pip install -e .)")
        else:
            try:
                lib = ctypes.CDLL(str(path))
                f = lib.kvt_post_segments
                f.restype = c_int64
                f.argtypes = [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                              c_void_p, c_int64, c_void_p, c_int64, c_int64,
                              POINTER(c_int64), POINTER(c_int64)]
                d = lib.kvt_progress_while
                d.restype = c_int64
                d.argtypes = [c_void_p, c_void_p, c_void_p, c_void_p, ctypes.c_int, c_int64]
                m = lib.kvt_memcpy_segments
                m.restype = c_uint64
                m.argtypes = [c_void_p, c_void_p, c_void_p, c_int64]
                _state["lib"], _state["why"] = lib, ""
            except (OSError, AttributeError) as exc:
                _state["lib"], _state["why"] = None, f"cannot load {path}: {exc}"
    return _state["lib"], _state["why"]  # type: ignore[return-value]


def resolve(option: object) -> str:
    """The posting path an agent uses: ``"native"`` or ``"ctypes"`` (see the module doc)."""
    mode = option if option is not None else os.environ.get(ENV, "auto")
    if mode not in MODES:
        src = "option post" if option is not None else f"environment variable {ENV}"
        raise BackendOptionError(f"ucx backend: {src} must be one of {list(MODES)}, got {mode!r}")
    if mode == "ctypes":
        return "ctypes"
    lib, why = library()
    if lib is not None:
        return "native"
    if mode == "native":
        raise BackendOptionError(f"ucx backend: post='native' but {why} (or use post='ctypes')")
    return "ctypes"


def fn_address(fn: object) -> int:
    """Address of a ctypes foreign function (handed to the C loop)."""
    return ctypes.cast(fn, c_void_p).value or 0


_MAX_PTR = (1 << 64) - 100  # (uintptr_t)UCS_ERR_LAST (_ucp.py): status pointers at or above are errors


class Poster:
    """Posts one lane's share of a transfer: ``ucp_put_nbx``/``ucp_get_nbx`` per merged
    segment, requests released at once (the caller holds the lane lock and flushes after)."""

    def __init__(self, ucp: Any, memory: Any, default_param: Any, native: bool) -> None:
        self._ucp = ucp
        self._memory = memory  # _memory.LocalMemory: per-region request parameters
        self._param = default_param  # ucp_request_param_t without a memory handle
        self._lib = library()[0] if native else None
        #: libucp addresses handed to the C loop: _rma[is_write] -> get / put.
        self._rma = (fn_address(ucp.ucp_get_nbx), fn_address(ucp.ucp_put_nbx))
        self._free = fn_address(ucp.ucp_request_free)
        self._progress = fn_address(ucp.ucp_worker_progress)
        self._check = fn_address(ucp.ucp_request_check_status)

    def drive(self, worker: int, req: int, inprogress: int, budget_s: float) -> int:
        """Progress ``worker`` while ``req`` is in progress and UCX does work, for at most
        ``budget_s`` (the caller holds the worker's lock); the calls that did work.

        Compiled: one call into ``kvt_progress_while`` without the GIL (with cma each
        progress call copies one 512 KiB fragment: 32 per 16 MiB, ~3 us each from Python).
        Fallback: the same loop in Python."""
        if self._lib is not None:
            return self._lib.kvt_progress_while(self._progress, self._check, worker, req, inprogress,
                                                int(budget_s * 1e9))
        progress, check = self._ucp.ucp_worker_progress, self._ucp.ucp_request_check_status
        until, rounds = time.perf_counter() + budget_s, 0
        while check(req) == inprogress and progress(worker):
            rounds += 1
            if time.perf_counter() >= until:
                break
        return rounds

    def post(self, write: bool, ep: int, la: np.ndarray, ra: np.ndarray, ln: np.ndarray,
             lr: np.ndarray, rks: int | np.ndarray) -> int:
        """Post the segments; 0, or the UCS status of the first refused post (nothing after
        it is posted). ``rks``: one remote key for all segments or one per segment."""
        if self._lib is not None:
            return self._post_native(write, ep, la, ra, ln, lr, rks)
        return self._post_ctypes(write, ep, la, ra, ln, lr, rks)

    def _post_ctypes(self, write: bool, ep: int, la: np.ndarray, ra: np.ndarray, ln: np.ndarray,
                     lr: np.ndarray, rks: int | np.ndarray) -> int:
        """The fallback: one foreign call per merged segment from this Python loop
        (~1.5-2.4 us per segment, docs/UCX.md)."""
        fn = self._ucp.ucp_put_nbx if write else self._ucp.ucp_get_nbx
        free = self._ucp.ucp_request_free
        pps = self._memory.local_params(lr, byref(self._param))
        keys = itertools.repeat(rks) if isinstance(rks, int) else rks.tolist()
        for a, b, n, rk, lp in zip(la.tolist(), ra.tolist(), ln.tolist(), keys, pps):
            r = fn(ep, a, n, b, rk, lp)
            if r:
                if r >= _MAX_PTR:
                    return r - (1 << 64)
                free(r)
        return 0

    def _post_native(self, write: bool, ep: int, la: np.ndarray, ra: np.ndarray, ln: np.ndarray,
                     lr: np.ndarray, rks: int | np.ndarray) -> int:
        """The whole list in one call into ``_post.c``: merges adjacent segments and posts
        them without the GIL (ctypes releases it around the call)."""
        la, ra, ln = (np.ascontiguousarray(v, np.uint64) for v in (la, ra, ln))
        lp = self._memory.local_param_table(lr, ctypes.addressof(self._param))
        rk_arr, rk_step = (np.array([rks], np.uint64), 0) if isinstance(rks, int) \
            else (np.ascontiguousarray(rks, np.uint64), 1)
        lp_arr, lp_step = (np.array([lp], np.uint64), 0) if isinstance(lp, int) \
            else (np.ascontiguousarray(lp, np.uint64), 1)
        st, at = c_int64(), c_int64()
        self._lib.kvt_post_segments(self._rma[write], self._free, ep, la.ctypes.data, ra.ctypes.data,
                                    ln.ctypes.data, rk_arr.ctypes.data, rk_step, lp_arr.ctypes.data,
                                    lp_step, len(ln), byref(st), byref(at))
        return st.value
