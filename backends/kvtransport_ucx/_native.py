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
import os
from ctypes import POINTER, c_int64, c_uint64, c_void_p
from pathlib import Path

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
