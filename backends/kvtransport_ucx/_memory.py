"""Local memory registration: ``ucp_mem_map`` handles, packed remote keys, and the
per-region operation parameters the data path posts with."""

from __future__ import annotations

import ctypes
import itertools
from ctypes import byref, c_size_t, c_void_p
from typing import Any

import numpy as np

from kvtransport.spi import LocalRegion

from . import _ucp as U
from ._worker import UcpWorker


class LocalMemory:
    """Memory handles of our registered regions (state lock held for every change)."""

    def __init__(self, w: UcpWorker) -> None:
        self._w = w
        self._ucp = w.ucp
        self._memh: dict[int, int] = {}
        #: Per region: operation parameters carrying its memory handle, so UCX skips the
        #: registration-cache lookup of the local buffer on every put/get.
        self.rparams: dict[int, U.ucp_request_param_t] = {}

    def register(self, region: LocalRegion) -> bytes:
        """Map the region and return its packed remote key (the region's metadata blob)."""
        p = U.ucp_mem_map_params_t()
        p.field_mask = (U.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | U.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                        | U.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
        p.address = region.addr
        p.length = region.length
        p.memory_type = U.UCS_MEMORY_TYPE_HOST
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
