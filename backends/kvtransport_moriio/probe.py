"""Can amd-mori run on this machine? One check per requirement, first failure wins.

``amd-mori`` is unusual among our transports: it publishes wheels only for CPython 3.10
and 3.12, its native library links against the ROCm 7 HIP runtime, and its RDMA backend
refuses to start without an RDMA device. A user who sees "moriio: unavailable" must learn
*which* of those fails and what to do about it, so each requirement is checked on its
own, in the order a user would fix them, and the reason names the first one that fails.

Everything the checks look at comes through :class:`HostFacts`, so tests can describe a
machine (a Python version, a file tree, a loadable library) without having one.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransport.spi import Availability

__all__ = [
    "SUPPORTED_PYTHONS",
    "REQUIRED_ROCM_MAJOR",
    "INSTALL_HINT",
    "HostFacts",
    "check_requirements",
    "rocm_version",
]

#: CPython versions amd-mori publishes wheels for (cp310, cp312).
SUPPORTED_PYTHONS: tuple[tuple[int, int], ...] = ((3, 10), (3, 12))
#: amd-mori 1.2 wheels link against libamdhip64.so.7.
REQUIRED_ROCM_MAJOR = 7
INSTALL_HINT = "pip install 'kvtransport[moriio]' (amd-mori) on Python 3.10 or 3.12 with ROCm 7 and an RDMA NIC"

_HIP_LIBS = ("libamdhip64.so.7", "libamdhip64.so")


def _try_load(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


@dataclass
class HostFacts:
    """The parts of the machine the checks read; defaults read the real machine."""

    python: tuple[int, int] = field(default_factory=lambda: (sys.version_info[0], sys.version_info[1]))
    root: str = "/"  # prefix for every absolute path below (tests point it at a tmp dir)
    rocm_path: str = field(default_factory=lambda: os.environ.get("ROCM_PATH", "/opt/rocm"))
    mori_installed: Callable[[], bool] = field(
        default_factory=lambda: lambda: importlib.util.find_spec("mori") is not None
    )
    load_library: Callable[[str], bool] = _try_load

    def path(self, p: str) -> str:
        return os.path.join(self.root, p.lstrip("/"))


def rocm_version(facts: HostFacts) -> str | None:
    """The installed ROCm version string (``/opt/rocm/.info/version``), or None."""
    for cand in (facts.rocm_path, "/opt/rocm"):
        try:
            with open(facts.path(os.path.join(cand, ".info", "version")), encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return text
    return None


def _rdma_devices(facts: HostFacts) -> list[str]:
    try:
        return sorted(os.listdir(facts.path("/sys/class/infiniband")))
    except OSError:
        return []


def check_requirements(facts: HostFacts | None = None, *, need_rdma: bool = True) -> Availability:
    """Check every requirement in order; the reason names the first that fails.

    ``need_rdma=False`` is for the XGMI transport (GPU to GPU inside one node), which
    does not need a NIC.
    """
    f = facts or HostFacts()
    py = f"{f.python[0]}.{f.python[1]}"
    if f.python not in SUPPORTED_PYTHONS:
        return Availability(
            False,
            f"amd-mori publishes wheels only for CPython 3.10 and 3.12; this is Python {py}",
            "run under Python 3.10 or 3.12, then pip install 'kvtransport[moriio]'",
        )
    if not f.mori_installed():
        return Availability(
            False,
            f"amd-mori is not installed (no module 'mori' on Python {py})",
            "pip install 'kvtransport[moriio]'  (installs amd-mori)",
        )
    version = rocm_version(f)
    if version is not None:
        major = version.split(".", 1)[0]
        if not major.isdigit() or int(major) < REQUIRED_ROCM_MAJOR:
            return Availability(
                False,
                f"amd-mori needs ROCm {REQUIRED_ROCM_MAJOR}; found ROCm {version} "
                f"({f.path(os.path.join(f.rocm_path, '.info', 'version'))})",
                f"install ROCm {REQUIRED_ROCM_MAJOR}.x (https://rocm.docs.amd.com)",
            )
    if not any(f.load_library(lib) for lib in _HIP_LIBS):
        where = f"ROCm {version} is installed but " if version else ""
        return Availability(
            False,
            f"amd-mori needs the ROCm {REQUIRED_ROCM_MAJOR} HIP runtime: {where}libamdhip64.so.7 "
            "cannot be loaded",
            f"install ROCm {REQUIRED_ROCM_MAJOR}.x and add its lib directory to LD_LIBRARY_PATH",
        )
    if not os.path.exists(f.path("/dev/kfd")):
        return Availability(
            False,
            "amd-mori needs an AMD GPU: /dev/kfd is missing (no amdgpu kernel driver)",
            "run on an AMD Instinct node with the amdgpu driver loaded",
        )
    if need_rdma and not _rdma_devices(f):
        return Availability(
            False,
            "amd-mori's RDMA backend needs an RDMA device: /sys/class/infiniband is empty or missing",
            "run on a node with an RDMA NIC (RoCE/InfiniBand) and rdma-core, or use transport='xgmi' "
            "inside one node",
        )
    return Availability(True)
