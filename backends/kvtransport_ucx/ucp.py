"""Minimal ctypes binding of the UCX ``ucp`` API: the handful of calls kvtransport needs.

Written against the UCP API **1.22** headers shipped in the ``libucx-cu12`` 1.22.0 wheel
(``libucx/include/ucp/api/ucp.h`` and ``ucp_def.h``). Every structure below is a
``field_mask``-versioned UCP parameter struct, so an older or newer ``libucp`` accepts it as
long as the fields we set existed in that version (RMA, AM with ``ucp_am_send_nbx`` and
``ucp_worker_set_am_recv_handler`` need UCX >= 1.11). ``tests/ucx/test_ucp_layout.py``
compiles a C program against the headers and checks every offset and size here.

Why ctypes and not a compiled extension: nothing to build at install time, and ctypes
releases the GIL around every foreign call, so a progress thread blocked in UCX does not
stall Python. The library is located with ``libucx.load_library()``, which honours
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`` (set it to use a system UCX, e.g. one with verbs).
This module only binds; policy lives in ``backend.py``.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char_p,
    c_int,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint64,
    c_ulong,
    c_void_p,
)

#: The UCP API version the structures below were written against.
UCP_API_MAJOR = 1
UCP_API_MINOR = 22

# -- status codes (ucs/type/status.h) ------------------------------------------------------
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_NO_MESSAGE = -2
UCS_ERR_INVALID_PARAM = -5
UCS_ERR_UNREACHABLE = -6
UCS_ERR_BUSY = -15
UCS_ERR_CANCELED = -16
UCS_ERR_UNSUPPORTED = -22
UCS_ERR_CONNECTION_RESET = -25
UCS_ERR_ENDPOINT_TIMEOUT = -80
UCS_ERR_LAST = -100

# -- enums / bit masks (ucp.h, ucp_def.h) --------------------------------------------------
UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_SERIALIZED = 1
UCS_THREAD_MODE_MULTI = 2

UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_MT_WORKERS_SHARED = 1 << 5
UCP_PARAM_FIELD_NAME = 1 << 8

UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_WAKEUP = 1 << 4
UCP_FEATURE_AM = 1 << 6

UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCP_WORKER_PARAM_FIELD_NAME = 1 << 6

UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_EP_PARAM_FIELD_USER_DATA = 1 << 3
UCP_EP_PARAM_FIELD_NAME = 1 << 7

UCP_ERR_HANDLING_MODE_NONE = 0
UCP_ERR_HANDLING_MODE_PEER = 1

UCP_EP_CLOSE_FLAG_FORCE = 1 << 0

UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_FLAGS = 1 << 2
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4

# ucs_memory_type_t (ucs/memory/memory_type.h): what ucp_mem_map and put/get are told the
# memory is, so UCX picks cuda_copy / cuda_ipc / GPUDirect (or rocm_*) instead of CPU copies.
UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1
UCS_MEMORY_TYPE_CUDA_MANAGED = 2
UCS_MEMORY_TYPE_ROCM = 3
UCS_MEMORY_TYPE_ROCM_MANAGED = 4
UCS_MEMORY_TYPE_NAMES = ("host", "cuda", "cuda-managed", "rocm", "rocm-managed", "rdma", "ze-host",
                         "ze-device", "ze-managed", "gaudi")

UCP_ATTR_FIELD_MEMORY_TYPES = 1 << 2  # ucp_context_attr_t.memory_types: types this context moves

UCP_AM_HANDLER_PARAM_FIELD_ID = 1 << 0
UCP_AM_HANDLER_PARAM_FIELD_FLAGS = 1 << 1
UCP_AM_HANDLER_PARAM_FIELD_CB = 1 << 2
UCP_AM_HANDLER_PARAM_FIELD_ARG = 1 << 3
UCP_AM_FLAG_WHOLE_MSG = 1 << 0

UCP_AM_SEND_FLAG_EAGER = 1 << 1
UCP_AM_SEND_FLAG_COPY_HEADER = 1 << 3
UCP_AM_RECV_ATTR_FLAG_RNDV = 1 << 17

UCP_OP_ATTR_FIELD_REQUEST = 1 << 0
UCP_OP_ATTR_FIELD_CALLBACK = 1 << 1
UCP_OP_ATTR_FIELD_USER_DATA = 1 << 2
UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
UCP_OP_ATTR_FIELD_MEMH = 1 << 8
UCP_OP_ATTR_FLAG_NO_IMM_CMPL = 1 << 16
UCP_OP_ATTR_FLAG_MULTI_SEND = 1 << 19

# -- structures ----------------------------------------------------------------------------


class ucp_params_t(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("features", c_uint64),
        ("request_size", c_size_t),
        ("request_init", c_void_p),
        ("request_cleanup", c_void_p),
        ("tag_sender_mask", c_uint64),
        ("mt_workers_shared", c_int),
        ("estimated_num_eps", c_size_t),
        ("estimated_num_ppn", c_size_t),
        ("name", c_char_p),
        ("node_local_id", c_size_t),
    ]


class ucs_cpu_set_t(Structure):
    _fields_ = [("ucs_bits", c_ulong * (1024 // (8 * ctypes.sizeof(c_ulong))))]


class ucp_worker_params_t(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("thread_mode", c_int),
        ("cpu_mask", ucs_cpu_set_t),
        ("events", c_uint),
        ("user_data", c_void_p),
        ("event_fd", c_int),
        ("flags", c_uint64),
        ("name", c_char_p),
        ("am_alignment", c_size_t),
        ("client_id", c_uint64),
    ]


#: void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status)
ERR_HANDLER_CB = CFUNCTYPE(None, c_void_p, c_void_p, c_int)


class ucp_err_handler_t(Structure):
    _fields_ = [("cb", c_void_p), ("arg", c_void_p)]


class ucs_sock_addr_t(Structure):
    _fields_ = [("addr", c_void_p), ("addrlen", c_uint32)]


class ucp_ep_params_t(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("err_mode", c_int),
        ("err_handler", ucp_err_handler_t),
        ("user_data", c_void_p),
        ("flags", c_uint),
        ("sockaddr", ucs_sock_addr_t),
        ("conn_request", c_void_p),
        ("name", c_char_p),
        ("local_sockaddr", ucs_sock_addr_t),
    ]


class ucp_mem_map_params_t(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("length", c_size_t),
        ("flags", c_uint),
        ("prot", c_uint),
        ("memory_type", c_int),
        ("exported_memh_buffer", c_void_p),
    ]


class ucp_context_attr_t(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("request_size", c_size_t),
        ("thread_mode", c_int),
        ("memory_types", c_uint64),
        ("name", ctypes.c_char * 32),  # UCP_ENTITY_NAME_MAX
        ("device_counter_size", c_size_t),
    ]


class ucp_request_param_t(Structure):
    _fields_ = [
        ("op_attr_mask", c_uint32),
        ("flags", c_uint32),
        ("request", c_void_p),
        ("cb", c_void_p),
        ("datatype", c_uint64),
        ("user_data", c_void_p),
        ("reply_buffer", c_void_p),
        ("memory_type", c_int),
        ("recv_info", c_void_p),
        ("memh", c_void_p),
        ("remote_datatype", c_uint64),
        ("remote", c_void_p),
        ("remote_count", c_size_t),
    ]


class ucp_am_recv_param_t(Structure):
    _fields_ = [("recv_attr", c_uint64), ("reply_ep", c_void_p)]


#: ucs_status_t (*ucp_am_recv_callback_t)(void *arg, const void *header, size_t header_length,
#:                                        void *data, size_t length, const ucp_am_recv_param_t *)
AM_RECV_CB = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_void_p, c_size_t, POINTER(ucp_am_recv_param_t))


class ucp_am_handler_param_t(Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("id", c_uint),
        ("flags", c_uint32),
        ("cb", c_void_p),
        ("arg", c_void_p),
    ]


#: C struct name -> ctypes class; ``tests/ucx/test_ucp_layout.py`` checks each against the headers.
LAYOUT = {
    "ucp_params_t": ucp_params_t,
    "ucp_worker_params_t": ucp_worker_params_t,
    "ucp_ep_params_t": ucp_ep_params_t,
    "ucp_mem_map_params_t": ucp_mem_map_params_t,
    "ucp_context_attr_t": ucp_context_attr_t,
    "ucp_request_param_t": ucp_request_param_t,
    "ucp_am_recv_param_t": ucp_am_recv_param_t,
    "ucp_am_handler_param_t": ucp_am_handler_param_t,
    "ucp_err_handler_t": ucp_err_handler_t,
}

# -- library loading -----------------------------------------------------------------------


class UcxLoadError(RuntimeError):
    """libucp could not be loaded (package missing or library broken)."""


P = POINTER


def _prototype(lib: ctypes.CDLL, name: str, restype, *argtypes) -> None:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


class Lib:
    """The loaded ``libucs`` + ``libucp`` with prototypes set. One per process."""

    def __init__(self) -> None:
        try:
            import libucx  # the libucx-cu12 wheel
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise UcxLoadError(
                "the 'libucx' module is missing; install it with `pip install 'kvtransport[ucx]'` "
                "(package libucx-cu12)"
            ) from exc
        libs = libucx.load_library()  # [libucs, libucs_signal, libuct, libucp]; None if absent
        if not libs or libs[0] is None or libs[-1] is None:
            raise UcxLoadError("libucx.load_library() did not find libucs/libucp")
        self.ucs, self.ucp = libs[0], libs[-1]
        self.path = getattr(self.ucp, "_name", "libucp.so")
        self.prefer_system = os.getenv("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false").lower() != "false"
        ucs, ucp = self.ucs, self.ucp
        _prototype(ucs, "ucs_status_string", c_char_p, c_int)
        _prototype(ucp, "ucp_get_version", None, P(c_uint), P(c_uint), P(c_uint))
        _prototype(ucp, "ucp_config_read", c_int, c_char_p, c_char_p, P(c_void_p))
        _prototype(ucp, "ucp_config_modify", c_int, c_void_p, c_char_p, c_char_p)
        _prototype(ucp, "ucp_config_release", None, c_void_p)
        _prototype(ucp, "ucp_init_version", c_int, c_uint, c_uint, P(ucp_params_t), c_void_p, P(c_void_p))
        _prototype(ucp, "ucp_cleanup", None, c_void_p)
        _prototype(ucp, "ucp_worker_create", c_int, c_void_p, P(ucp_worker_params_t), P(c_void_p))
        _prototype(ucp, "ucp_worker_destroy", None, c_void_p)
        _prototype(ucp, "ucp_worker_get_address", c_int, c_void_p, P(c_void_p), P(c_size_t))
        _prototype(ucp, "ucp_worker_release_address", None, c_void_p, c_void_p)
        _prototype(ucp, "ucp_worker_progress", c_uint, c_void_p)
        _prototype(ucp, "ucp_worker_get_efd", c_int, c_void_p, P(c_int))
        _prototype(ucp, "ucp_worker_arm", c_int, c_void_p)
        _prototype(ucp, "ucp_worker_signal", c_int, c_void_p)
        _prototype(ucp, "ucp_worker_set_am_recv_handler", c_int, c_void_p, P(ucp_am_handler_param_t))
        _prototype(ucp, "ucp_ep_create", c_int, c_void_p, P(ucp_ep_params_t), P(c_void_p))
        _prototype(ucp, "ucp_ep_close_nbx", c_void_p, c_void_p, P(ucp_request_param_t))
        _prototype(ucp, "ucp_ep_flush_nbx", c_void_p, c_void_p, P(ucp_request_param_t))
        _prototype(ucp, "ucp_context_query", c_int, c_void_p, P(ucp_context_attr_t))
        _prototype(ucp, "ucp_mem_map", c_int, c_void_p, P(ucp_mem_map_params_t), P(c_void_p))
        _prototype(ucp, "ucp_mem_unmap", c_int, c_void_p, c_void_p)
        _prototype(ucp, "ucp_rkey_pack", c_int, c_void_p, c_void_p, P(c_void_p), P(c_size_t))
        _prototype(ucp, "ucp_rkey_buffer_release", None, c_void_p)
        _prototype(ucp, "ucp_ep_rkey_unpack", c_int, c_void_p, c_void_p, P(c_void_p))
        _prototype(ucp, "ucp_rkey_destroy", None, c_void_p)
        _prototype(ucp, "ucp_put_nbx", c_void_p, c_void_p, c_void_p, c_size_t, c_uint64, c_void_p,
                   P(ucp_request_param_t))
        _prototype(ucp, "ucp_get_nbx", c_void_p, c_void_p, c_void_p, c_size_t, c_uint64, c_void_p,
                   P(ucp_request_param_t))
        _prototype(ucp, "ucp_am_send_nbx", c_void_p, c_void_p, c_uint, c_void_p, c_size_t, c_void_p,
                   c_size_t, P(ucp_request_param_t))
        _prototype(ucp, "ucp_request_check_status", c_int, c_void_p)
        _prototype(ucp, "ucp_request_cancel", None, c_void_p, c_void_p)
        _prototype(ucp, "ucp_request_free", None, c_void_p)

    def version(self) -> str:
        a, b, c = c_uint(), c_uint(), c_uint()
        self.ucp.ucp_get_version(ctypes.byref(a), ctypes.byref(b), ctypes.byref(c))
        return f"{a.value}.{b.value}.{c.value}"

    def status_string(self, status: int) -> str:
        s = self.ucs.ucs_status_string(status)
        return s.decode() if s else f"ucs status {status}"


_LIB: Lib | None = None


def lib() -> Lib:
    """Load (once) and return the bound library; raises :class:`UcxLoadError`."""
    global _LIB
    if _LIB is None:
        _LIB = Lib()
    return _LIB


# -- status pointer helpers (UCS_PTR_IS_ERR & co, ucs/type/status.h) ------------------------
_ERR_THRESHOLD = (1 << 64) + UCS_ERR_LAST  # (uintptr_t)UCS_ERR_LAST


def ptr_status(ptr: int | None) -> int:
    """Decode a ``ucs_status_ptr_t``: UCS_OK (NULL), an error code, or UCS_INPROGRESS (a request)."""
    if not ptr:
        return UCS_OK
    if ptr >= _ERR_THRESHOLD:
        return ptr - (1 << 64)
    return UCS_INPROGRESS


class UcxError(RuntimeError):
    """A UCX call failed; carries the ``ucs_status_t``."""

    def __init__(self, what: str, status: int) -> None:
        self.status = status
        msg = lib().status_string(status) if _LIB is not None else str(status)
        super().__init__(f"{what} failed: {msg} ({status})")


class UcxConfigError(UcxError):
    """UCX refused the settings: ``ucp_config_modify`` (unknown name or bad value), or the
    transports would not open with them (settings that conflict with each other)."""


def check(status: int, what: str) -> None:
    if status != UCS_OK:
        raise UcxError(what, status)
