"""The compiled posting path (``_post.c``) and the choice between it and the ctypes loop.

``_post.c`` is built at install time as an optional setuptools extension (pyproject.toml,
``[tool.setuptools] ext-modules``): where no C compiler is available the install still
succeeds and the backend posts from Python. It is a plain shared library loaded with
ctypes (it does not include Python.h), and it calls ``ucp_put_nbx`` / ``ucp_get_nbx``,
the flush, progress and status functions through pointers taken from the libucp the
backend already loaded, so it works with the wheel's UCX and with a system UCX alike.
One lane's share of a transfer is one foreign call (:meth:`Poster.share`): post every
segment, flush, drive the lane while the flush is in progress, release a flush that ended.

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
import weakref
from ctypes import POINTER, byref, c_int64, c_uint64, c_void_p
from pathlib import Path
from typing import Any

import numpy as np

from kvtransport.errors import BackendOptionError

from .ucp import UCS_INPROGRESS

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
                d = lib.kvt_post_share
                d.restype = None
                d.argtypes = [c_void_p, ctypes.c_int, c_void_p, c_void_p, c_void_p, c_int64, c_void_p]
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


_MAX_PTR = (1 << 64) - 100  # (uintptr_t)UCS_ERR_LAST (ucp.py): status pointers at or above are errors


class _Ucp(ctypes.Structure):
    """``struct kvt_ucp`` of ``_post.c``: the libucp functions a share needs."""
    _fields_ = [("get", c_void_p), ("put", c_void_p), ("release", c_void_p), ("flush", c_void_p),
                ("progress", c_void_p), ("check", c_void_p), ("flush_param", c_void_p),
                ("inprogress", c_int64)]


class _Share(ctypes.Structure):
    """``struct kvt_share``: one lane's segments. ``rkey`` / ``param`` hold the one key and
    parameter of the common one-region case (``rkeys`` / ``params`` then point at them)."""
    _fields_ = [("laddr", c_void_p), ("raddr", c_void_p), ("len", c_void_p), ("rkeys", c_void_p),
                ("rkey_step", c_int64), ("params", c_void_p), ("param_step", c_int64), ("n", c_int64),
                ("rkey", c_void_p), ("param", c_void_p)]


class _Outcome(ctypes.Structure):
    """``struct kvt_outcome``: what became of a share."""
    _fields_ = [("rma_status", c_int64), ("failed_at", c_int64), ("flush", c_void_p),
                ("flush_status", c_int64)]


_RKEY_AT, _PARAM_AT = _Share.rkey.offset, _Share.param.offset


class _Addresses:
    """Data addresses of a share's three arrays, remembered per array object.

    Why: a prepared transfer posts the very same (read-only) arrays every time, and asking
    numpy for an address costs ~1 us each. An entry lives as long as its local-address array
    (a weak reference removes it), and is used only when all three arrays are the ones it
    was made for, so a recycled ``id`` can never return another array's addresses."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, Any, Any, tuple[int, int, int]]] = {}

    def __call__(self, la: np.ndarray, ra: np.ndarray, ln: np.ndarray) -> tuple[int, int, int]:
        key = id(la)
        e = self._by_id.get(key)
        if e is not None and e[0]() is la and e[1]() is ra and e[2]() is ln:
            return e[3]
        addrs = (la.ctypes.data, ra.ctypes.data, ln.ctypes.data)
        by_id = self._by_id
        self._by_id[key] = (weakref.ref(la, lambda _, k=key: by_id.pop(k, None)),
                            weakref.ref(ra), weakref.ref(ln), addrs)
        return addrs


class Poster:
    """Posts one lane's share of a transfer and flushes it (the caller holds the lane lock):
    ``ucp_put_nbx``/``ucp_get_nbx`` per merged segment, requests released at once, then
    ``ucp_ep_flush_nbx``, then optionally drives the lane while the flush is in progress."""

    def __init__(self, ucp: Any, memory: Any, default_param: Any, native: bool) -> None:
        self._ucp = ucp
        self._memory = memory  # _memory.LocalMemory: per-region request parameters
        self._param = default_param  # ucp_request_param_t without a memory handle (also the flush's)
        self._lib = library()[0] if native else None
        self._api = _Ucp(fn_address(ucp.ucp_get_nbx), fn_address(ucp.ucp_put_nbx),
                         fn_address(ucp.ucp_request_free), fn_address(ucp.ucp_ep_flush_nbx),
                         fn_address(ucp.ucp_worker_progress), fn_address(ucp.ucp_request_check_status),
                         ctypes.addressof(default_param), UCS_INPROGRESS)
        self._addresses = _Addresses()

    def share(self, write: bool, worker: int, ep: int, la: np.ndarray, ra: np.ndarray, ln: np.ndarray,
              lr: np.ndarray, rks: int | np.ndarray, budget_s: float) -> tuple[int, int | None, int]:
        """Post the segments, flush, and drive ``worker`` while the flush is in progress and
        UCX does work, for at most ``budget_s`` (0: no driving; with cma the copy runs inside
        progress calls, one 512 KiB fragment each). ``rks``: one remote key for all segments
        or one per segment.

        Returns (0 or the UCS status of the first refused RMA post - nothing after it was
        posted -, the flush request if it is still in progress else None, the flush's
        status: UCS_OK or an error once it ended, its request already released, else
        UCS_INPROGRESS). Compiled: one call into ``kvt_post_share`` without the GIL.
        Fallback: the same steps from Python."""
        if self._lib is not None:
            return self._share_native(write, worker, ep, la, ra, ln, lr, rks, budget_s)
        return self._share_ctypes(write, worker, ep, la, ra, ln, lr, rks, budget_s)

    def _share_native(self, write: bool, worker: int, ep: int, la: np.ndarray, ra: np.ndarray,
                      ln: np.ndarray, lr: np.ndarray, rks: int | np.ndarray,
                      budget_s: float) -> tuple[int, int | None, int]:
        la, ra, ln = (np.ascontiguousarray(v, np.uint64) for v in (la, ra, ln))
        s = _Share()
        s.laddr, s.raddr, s.len = self._addresses(la, ra, ln)
        s.n = len(ln)
        base = ctypes.addressof(s)
        if isinstance(rks, int):
            s.rkey, s.rkeys = rks, base + _RKEY_AT  # rkey_step 0: one key for every segment
        else:
            rks = np.ascontiguousarray(rks, np.uint64)  # kept alive by this frame during the call
            s.rkeys, s.rkey_step = rks.ctypes.data, 1
        lp = self._memory.local_param_table(lr, ctypes.addressof(self._param))
        if isinstance(lp, int):
            s.param, s.params = lp, base + _PARAM_AT
        else:
            lp = np.ascontiguousarray(lp, np.uint64)
            s.params, s.param_step = lp.ctypes.data, 1
        out = _Outcome()
        self._lib.kvt_post_share(byref(self._api), write, worker, ep, byref(s), int(budget_s * 1e9), byref(out))
        return out.rma_status, out.flush, out.flush_status

    def _share_ctypes(self, write: bool, worker: int, ep: int, la: np.ndarray, ra: np.ndarray,
                      ln: np.ndarray, lr: np.ndarray, rks: int | np.ndarray,
                      budget_s: float) -> tuple[int, int | None, int]:
        """The fallback: one foreign call per merged segment from this Python loop
        (~1.5-2.4 us per segment, docs/UCX.md), then the flush and the progress loop."""
        ucp = self._ucp
        fn = ucp.ucp_put_nbx if write else ucp.ucp_get_nbx
        free = ucp.ucp_request_free
        pps = self._memory.local_params(lr, byref(self._param))
        keys = itertools.repeat(rks) if isinstance(rks, int) else rks.tolist()
        rma_st = 0
        for a, b, n, rk, lp in zip(la.tolist(), ra.tolist(), ln.tolist(), keys, pps):
            r = fn(ep, a, n, b, rk, lp)
            if r:
                if r >= _MAX_PTR:
                    rma_st = r - (1 << 64)
                    break
                free(r)
        r = ucp.ucp_ep_flush_nbx(ep, byref(self._param))
        if not r:
            return rma_st, None, 0
        if r >= _MAX_PTR:
            return rma_st, None, r - (1 << 64)
        progress, check = ucp.ucp_worker_progress, ucp.ucp_request_check_status
        until = time.perf_counter() + budget_s
        while budget_s > 0 and check(r) == UCS_INPROGRESS and progress(worker):
            if time.perf_counter() >= until:
                break
        st = check(r)
        if st == UCS_INPROGRESS:
            return rma_st, r, st
        free(r)
        return rma_st, None, st
