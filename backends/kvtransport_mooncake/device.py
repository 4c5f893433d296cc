"""Device memory on Mooncake: whether the loaded engine can register it, and how.

Mooncake's Transfer Engine moves GPU memory only when it was built with CUDA (``USE_CUDA``),
as the ``mooncake-transfer-engine`` wheel is: its RDMA transport registers device memory
with the NIC (GPUDirect RDMA) and its TCP transport copies device memory through host
memory with ``cudaMemcpy`` on the side that owns it. The build says which it is itself:
``mooncake.engine.SUPPORT_CUDA`` is compiled from the same switch. The non-CUDA wheel
(``mooncake-transfer-engine-non-cuda``) takes every address for host memory -- it asks libnuma
where the pages are and its TCP transport reads and writes them with the CPU -- so a device
region is refused at ``register``, before the engine sees the address, with the fix.

A device region is registered at Mooncake's location ``cuda:N`` (its GPU), which Mooncake
uses to choose the NICs nearest that GPU; host memory keeps the wildcard ``*`` (Mooncake
looks its NUMA node up itself).

The decisions (:func:`supports_cuda`, :func:`location`) take the engine module or its
answer as input, so they are checked for both builds on a host that has only one.
"""

from __future__ import annotations

from typing import Any

from kvtransport.errors import UnsupportedMemoryKindError

__all__ = ["CUDA_WHEEL", "MooncakeMemoryKindUnavailable", "supports_cuda", "location", "installed_distribution"]

#: The pip distribution of Mooncake's CUDA build.
CUDA_WHEEL = "mooncake-transfer-engine"
#: The flag ``mooncake.engine`` sets from its build switch.
FLAG = "SUPPORT_CUDA"
WILDCARD = "*"


def supports_cuda(engine_module: Any) -> bool | None:
    """Whether ``engine_module`` (``mooncake.engine``) was built with CUDA: its own
    ``SUPPORT_CUDA`` flag; None when the build does not say (no such flag)."""
    flag = getattr(engine_module, FLAG, None)
    return None if flag is None else flag is True


def location(kind: str, device: int, cuda: bool | None) -> str | None:
    """Mooncake's location for a region of ``kind`` on ``device``, for an engine whose
    CUDA support is ``cuda``; None when that engine cannot register the kind."""
    if kind == "cpu":
        return WILDCARD
    if kind == "cuda" and cuda:
        return f"cuda:{max(device, 0)}"
    return None


def installed_distribution() -> str:
    """The pip distribution(s) that installed the ``mooncake`` package ("" if none known)."""
    from importlib.metadata import packages_distributions  # error path only: scans site-packages

    return ", ".join(sorted(set(packages_distributions().get("mooncake", []))))


class MooncakeMemoryKindUnavailable(UnsupportedMemoryKindError):
    """The mooncake backend moves this kind with a CUDA build of Mooncake; the engine
    loaded here is not one."""

    def __init__(self, kind: str, cuda: bool | None, distribution: str, alternatives: list[str]) -> None:
        super().__init__("mooncake", kind, ["cpu"], alternatives)
        dist = f" ({distribution})" if distribution else ""
        if cuda is None:
            why = (f"the installed Mooncake Transfer Engine{dist} does not say whether it was built with CUDA "
                   f"(mooncake.engine has no {FLAG}: a release older than the one tested, 0.3.13)")
        else:
            why = f"the installed Mooncake Transfer Engine{dist} was built without CUDA (mooncake.engine.{FLAG} is False)"
        fix = (f"install Mooncake's CUDA build: pip uninstall -y mooncake-transfer-engine-non-cuda && pip install "
               f"'{CUDA_WHEEL}>=0.3.13' (CUDA 12.1+)")
        self.args = (f"{self.args[0]}. Why: {why}. Fix: {fix}; or keep the KV cache on the device and stage it "
                     "through host memory (vLLM connector: kv_buffer_device 'cpu').",)
