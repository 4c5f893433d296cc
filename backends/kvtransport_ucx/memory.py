"""Local memory registration: ``ucp_mem_map`` handles, packed remote keys, and the
per-region operation parameters the data path posts with.

Device memory: a ``cuda`` region is mapped as ``UCS_MEMORY_TYPE_CUDA`` and a ``rocm`` one
as ``UCS_MEMORY_TYPE_ROCM``, and every put/get on it carries that memory type, so UCX
moves it with its device transports (cuda_copy, cuda_ipc, GPUDirect RDMA / rocm_copy,
rocm_ipc) and never treats it as host memory. Whether the loaded UCX can is asked of the
context (``ucp_context_query``, ``memory_types``), and a kind the context lacks is refused
at ``register``, before ``ucp_mem_map`` sees the address, with the reason and the fix. There
are two reasons, told apart by asking UCX (:func:`device_kinds_here`): UCX loads its CUDA
modules only where the CUDA driver is present, and it closes every memory domain none of
whose transports the transport list selects, so a context whose list leaves out the device
transports (``UCX_TLS=tcp``) reports no CUDA even on a GPU host. The backend has no CPU data
path of its own (no memmove, no numpy view of registered memory): bytes only move inside UCX.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from ctypes import byref, c_size_t, c_void_p
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtransport.errors import UnsupportedMemoryKindError
from kvtransport.spi import LocalRegion

from . import ucp as U
from kvtransport.ucx_config import DEVICE_TLS_ALIAS
from .worker import UcpWorker


#: memory kind -> the UCS memory type it is mapped and posted as
MEMORY_TYPES = {"cpu": U.UCS_MEMORY_TYPE_HOST, "cuda": U.UCS_MEMORY_TYPE_CUDA, "rocm": U.UCS_MEMORY_TYPE_ROCM}

_HOW = {
    "cuda": "UCX loads its CUDA transports (libuct_cuda: cuda_copy, cuda_ipc) only where the CUDA driver "
            "(libcuda.so) is present: run on a host with an NVIDIA GPU and driver, with the libucx-cu12 wheel "
            "or a system UCX built --with-cuda (`ucx_info -d | grep cuda` lists them)",
    "rocm": "the loaded UCX has no ROCm transports (the libucx-cu12 wheel is built without them): use a system "
            "UCX built --with-rocm (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true), or the moriio backend",
}


class UcxMemoryKindUnavailable(UnsupportedMemoryKindError):
    """The ucx backend can move this kind on suitable hosts, but the UCX loaded here cannot."""

    def __init__(self, kind: str, context_types: list[str], alternatives: list[str],
                 why: str | None = None) -> None:
        super().__init__("ucx", kind, [k for k, t in MEMORY_TYPES.items()
                                       if U.UCS_MEMORY_TYPE_NAMES[t] in context_types], alternatives)
        self.args = (f"{self.args[0]}. Why: this UCX context moves only {context_types} memory; "
                     f"{why or _HOW.get(kind, '')}. Or keep the KV cache on the device and stage it through "
                     "host memory (vLLM connector: kv_buffer_device 'cpu').",)


class UcxDeviceTransportsExcluded(UcxMemoryKindUnavailable):
    """The UCX loaded here moves this kind on this host, but this agent's transport list
    leaves out the transports that do (UCX then closes their memory domain)."""

    def __init__(self, kind: str, context_types: list[str], alternatives: list[str]) -> None:
        alias = DEVICE_TLS_ALIAS.get(kind, kind)
        super().__init__(kind, context_types, alternatives, why=(
            f"the UCX loaded here has its {kind} transports on this host (UCX_TLS alias '{alias}'), but this "
            f"agent's transport list leaves them out, and UCX closes the {kind} memory domain then. Fix: open "
            f"the agent with device_memory='{kind}' (adds '{alias}' to the ucx option tls), or add '{alias}' "
            f"yourself (tls='tcp,{alias}'; in the environment UCX_TLS=tcp,{alias}), or drop the list "
            "(UCX's default uses every transport)"))


@functools.cache
def device_kinds_here() -> frozenset[str]:
    """The device memory kinds the loaded UCX can move on this host when its device
    transports are selected: the memory types of a throw-away context whose transport list
    is ``self`` plus the device aliases (about a millisecond, once per process).

    This is what tells "no CUDA driver / no CUDA module" from "the transport list leaves
    the CUDA transports out"; ``WARN_INVALID_CONFIG=n`` keeps UCX from warning about the
    aliases a GPU-less host lacks. Empty when UCX refuses the context."""
    ucp = U.lib().ucp
    cfg = c_void_p()
    if ucp.ucp_config_read(None, None, byref(cfg)) != U.UCS_OK:
        return frozenset()
    try:
        for key, value in (("TLS", ",".join(["self", *DEVICE_TLS_ALIAS.values()])),
                           ("WARN_INVALID_CONFIG", "n")):
            if ucp.ucp_config_modify(cfg, key.encode(), value.encode()) != U.UCS_OK:
                return frozenset()
        params = U.ucp_params_t()
        params.field_mask = U.UCP_PARAM_FIELD_FEATURES
        params.features = U.UCP_FEATURE_RMA
        ctx = c_void_p()
        if ucp.ucp_init_version(U.UCP_API_MAJOR, U.UCP_API_MINOR, byref(params), cfg, byref(ctx)) != U.UCS_OK:
            return frozenset()
    finally:
        ucp.ucp_config_release(cfg)
    try:
        mask = context_memory_types(ucp, ctx)
    finally:
        ucp.ucp_cleanup(ctx)
    return frozenset(k for k in DEVICE_TLS_ALIAS if mask & (1 << MEMORY_TYPES[k]))


def context_memory_types(ucp: Any, context: Any) -> int:
    """Bit mask of the UCS memory types the context can move (``ucp_context_query``)."""
    attr = U.ucp_context_attr_t()
    attr.field_mask = U.UCP_ATTR_FIELD_MEMORY_TYPES
    U.check(ucp.ucp_context_query(context, byref(attr)), "ucp_context_query")
    return int(attr.memory_types)


def type_names(mask: int) -> list[str]:
    return [n for i, n in enumerate(U.UCS_MEMORY_TYPE_NAMES) if mask & (1 << i)]


class LocalMemory:
    """Memory handles of our registered regions (state lock held for every change)."""

    def __init__(self, w: UcpWorker,
                 kinds_here: Callable[[], frozenset[str]] = device_kinds_here) -> None:
        """``kinds_here``: the device kinds this UCX moves on this host with its device
        transports selected (asked only to explain a refusal)."""
        self._w = w
        self._kinds_here = kinds_here
        self._ucp = w.ucp
        self._memh: dict[int, int] = {}
        #: Per region: operation parameters carrying its memory handle, so UCX skips the
        #: registration-cache lookup of the local buffer on every put/get.
        self.rparams: dict[int, U.ucp_request_param_t] = {}
        #: UCS memory types the context moves (asked once, at the first register)
        self._context_types: int | None = None

    def memory_type(self, region: LocalRegion) -> int:
        """The UCS memory type to map ``region`` as; refuses a kind this UCX cannot move,
        before any UCX call sees the address."""
        mtype = MEMORY_TYPES.get(region.kind)
        if mtype is None:  # the core only passes declared kinds; defensive
            raise UnsupportedMemoryKindError("ucx", region.kind, sorted(MEMORY_TYPES), [])
        if mtype == U.UCS_MEMORY_TYPE_HOST:
            return mtype
        if self._context_types is None:
            with self._w.lock:
                self._context_types = context_memory_types(self._ucp, self._w.context)
        if not self._context_types & (1 << mtype):
            from kvtransport.registry import backends_for_memory_kind  # error path only

            others = [b for b in backends_for_memory_kind(region.kind) if b.split(" ")[0] != "ucx"]
            error = UcxDeviceTransportsExcluded if region.kind in self._kinds_here() else UcxMemoryKindUnavailable
            raise error(region.kind, type_names(self._context_types), others)
        return mtype

    def register(self, region: LocalRegion) -> bytes:
        """Map the region and return its packed remote key (the region's metadata blob)."""
        mtype = self.memory_type(region)
        p = U.ucp_mem_map_params_t()
        p.field_mask = (U.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | U.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                        | U.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
        p.address = region.addr
        p.length = region.length
        p.memory_type = mtype
        memh, buf, size = c_void_p(), c_void_p(), c_size_t()
        with self._w.lock:
            U.check(self._ucp.ucp_mem_map(self._w.context, byref(p), byref(memh)), "ucp_mem_map")
            st = self._ucp.ucp_rkey_pack(self._w.context, memh, byref(buf), byref(size))
            if st != U.UCS_OK:
                self._ucp.ucp_mem_unmap(self._w.context, memh)
                U.check(st, "ucp_rkey_pack")
            blob = ctypes.string_at(buf, size.value)
            self._ucp.ucp_rkey_buffer_release(buf)
            self._memh[region.id] = memh.value
            rp = U.ucp_request_param_t()
            rp.op_attr_mask = U.UCP_OP_ATTR_FIELD_MEMH
            rp.memh = memh.value
            if mtype != U.UCS_MEMORY_TYPE_HOST:  # device memory: say so on every put/get
                rp.op_attr_mask |= U.UCP_OP_ATTR_FIELD_MEMORY_TYPE
                rp.memory_type = mtype
            self.rparams[region.id] = rp
        return blob

    def deregister(self, region: LocalRegion) -> None:
        with self._w.lock:
            self.rparams.pop(region.id, None)
            memh = self._memh.pop(region.id, None)
            if memh is not None:
                U.check(self._ucp.ucp_mem_unmap(self._w.context, memh), "ucp_mem_unmap")

    def unmap_all(self) -> None:
        """At shutdown, after every endpoint is closed (lock held)."""
        for memh in self._memh.values():
            self._ucp.ucp_mem_unmap(self._w.context, memh)
        self._memh.clear()
        self.rparams.clear()

    def local_params(self, regions: np.ndarray, default: Any) -> Any:
        """Per-segment request parameters carrying the local memory handle of its region
        (an iterable as long as ``regions``)."""
        if regions.size == 1 or bool((regions == regions[0]).all()):
            rp = self.rparams.get(int(regions[0]))
            return itertools.repeat(byref(rp) if rp is not None else default)
        uniq, inv = np.unique(regions, return_inverse=True)
        refs = [byref(self.rparams[u]) if u in self.rparams else default for u in uniq.tolist()]
        return [refs[i] for i in inv.tolist()]

    def local_param_table(self, regions: np.ndarray, default: int) -> int | np.ndarray:
        """Addresses of the per-segment request parameters for the compiled posting path:
        one address for every segment (the common one-region case) or one per segment.
        ``default`` is the address of the parameters without a memory handle."""
        if regions.size == 1 or bool((regions == regions[0]).all()):
            rp = self.rparams.get(int(regions[0]))
            return ctypes.addressof(rp) if rp is not None else default
        uniq, inv = np.unique(regions, return_inverse=True)
        addrs = np.array([ctypes.addressof(self.rparams[u]) if u in self.rparams else default
                          for u in uniq.tolist()], np.uint64)
        return addrs[inv]
