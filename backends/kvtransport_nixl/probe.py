"""Finding NIXL and its plugins, and saying precisely why the backend cannot run.

The NIXL Python API ships in a CUDA-flavoured wheel (``nixl-cu12`` -> module ``nixl_cu12``)
with its plugins and its own UCX bundled; the ``nixl`` meta package only picks one of those
wheels. We import the flavoured module directly (the meta package may import torch to
learn the CUDA version, a second of start-up for nothing on a CPU host).

Plugin facts (names, init parameters, memory kinds) come from a throw-away NIXL agent
created once per process, without a progress thread.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvtransport.spi import Availability

INSTALL_HINT = "pip install 'kvtransport[nixl]'  (installs nixl-cu12, which bundles its plugins and UCX)"
#: Flavoured wheels first (no torch import), the meta package last.
_MODULES = ("nixl_cu12", "nixl_cu13", "nixl_rocm", "nixl")
_lock = threading.Lock()


#: UCX modules left out on a host without an RDMA device. NIXL's bundled UCX ib modules
#: link a bundled copy of libnl-route; once the system's libibverbs is installed (Mooncake
#: needs it) they load next to the system's libnl-route, and the two copies crash the
#: process in libnl-route's destructor at exit (SIGSEGV in rtnl_tc_unregister, exit code
#: 139, even after every agent was closed). UCX reads ``UCX_MODULES`` once, when its
#: library loads (before any agent exists), so this is a process-wide default set just
#: before NIXL is first imported; without a device those modules have nothing to drive.
#: An explicit ``UCX_MODULES`` is left alone.
NO_RDMA_MODULES = "^ib*"


def has_rdma_device() -> bool:
    """Whether the kernel lists an RDMA device (``/sys/class/infiniband``)."""
    try:
        return any(os.scandir("/sys/class/infiniband"))
    except OSError:
        return False


@functools.cache
def load_nixl() -> tuple[ModuleType | None, str]:
    """The NIXL API module, or None and why not (each module tried, with its error)."""
    if "UCX_MODULES" not in os.environ and not has_rdma_device():
        os.environ["UCX_MODULES"] = NO_RDMA_MODULES
    errors = []
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken install raising anything else
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(mod, "nixl_agent"):
            _quiet_logging()
            return mod, ""
        errors.append(f"{name}: has no nixl_agent")
    return None, "; ".join(errors)


def _quiet_logging() -> None:
    """NIXL's Python logger prints INFO lines (one per agent) to *stdout*, which would mix
    into a program's output (``kvtransport backends --json``). Keep warnings unless the
    user chose a level with NIXL's own ``NIXL_LOG_LEVEL``."""
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


def nixl() -> ModuleType:
    mod, why = load_nixl()
    if mod is None:
        raise ImportError(f"NIXL is not installed ({why})")
    return mod


@dataclass
class PluginInfo:
    """What the installed NIXL offers: plugin names, and per queried plugin its init
    parameters with defaults and the memory segment kinds it handles."""

    plugins: list[str]
    agent: Any = None
    params: dict[str, dict[str, str]] = field(default_factory=dict)
    mem_types: dict[str, list[str]] = field(default_factory=dict)

    def describe(self, plugin: str) -> tuple[dict[str, str], list[str]] | None:
        """(init parameters, memory kinds) of ``plugin``; None if NIXL cannot load it."""
        with _lock:
            if plugin not in self.params:
                try:
                    p, m = self.agent.agent.getPluginParams(plugin)
                except Exception:
                    return None
                self.params[plugin], self.mem_types[plugin] = dict(p), list(m)
            return self.params[plugin], self.mem_types[plugin]


@functools.cache
def plugin_info() -> PluginInfo:
    """Plugin facts from a probe agent (raises what NIXL raises when it cannot start one)."""
    m = nixl()
    cfg = m.nixl_agent_config(enable_prog_thread=False, backends=[])
    agent = m.nixl_agent(f"kvt-probe-{os.getpid()}", cfg)
    return PluginInfo(list(agent.get_plugin_list()), agent)


def _plugin_dir() -> str:
    return os.environ.get("NIXL_PLUGIN_DIR", "(unset: the wheel's bundled plugins)")


@functools.cache
def probe() -> Availability:
    """Can the backend run here with its default plugin (UCX) on CPU memory?"""
    mod, why = load_nixl()
    if mod is None:
        return Availability(False, f"NIXL is not installed (tried {why})", INSTALL_HINT)
    try:
        info = plugin_info()
    except Exception as exc:
        return Availability(False, f"NIXL cannot start an agent: {type(exc).__name__}: {exc} "
                                   f"(NIXL_PLUGIN_DIR={_plugin_dir()})", INSTALL_HINT)
    if "UCX" not in info.plugins:
        return Availability(False, f"NIXL has no UCX plugin (plugins found: {info.plugins or 'none'}; "
                                   f"NIXL_PLUGIN_DIR={_plugin_dir()})", INSTALL_HINT)
    desc = info.describe("UCX")
    if desc is None:
        return Availability(False, "NIXL's UCX plugin is present but cannot be loaded "
                                   f"(NIXL_PLUGIN_DIR={_plugin_dir()})", INSTALL_HINT)
    if "DRAM_SEG" not in desc[1]:
        return Availability(False, f"NIXL's UCX plugin does not handle CPU memory (it reports {desc[1]})",
                            INSTALL_HINT)
    return Availability(True)


#: NVIDIA GPU device nodes: ``/dev/nvidia<N>`` (not nvidiactl, nvidia-uvm, nvidia-modeset).
_GPU_NODE = re.compile(r"nvidia[0-9]+")
_CUDA_SUCCESS = 0
_NVML_SUCCESS = 0


def load_library(name: str) -> Any | None:
    """The shared library ``name`` through ctypes, or None where it is not installed."""
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def gpu_count(dev_dir: str = "/dev", load: Callable[[str], Any | None] = load_library) -> int:
    """How many NVIDIA GPUs this process can see (VRAM registration is offered only then).

    Asked in this order, each where it answers:

    1. the CUDA driver (``libcuda.so.1``), if CUDA is already initialised in this process
       (``cuDeviceGetCount`` succeeds; it honours ``CUDA_VISIBLE_DEVICES``). We never call
       ``cuInit`` ourselves: initialising CUDA is process-wide, and a process that forks
       workers after it (vLLM's fork start method) leaves them unable to use CUDA;
    2. NVML (``libnvidia-ml.so.1``): ``nvmlInit_v2`` / ``nvmlDeviceGetCount_v2``, the devices
       this container was given, without touching CUDA;
    3. the device nodes ``dev_dir/nvidia<N>``, any N: a container keeps the physical number,
       so a pod given GPU 3 sees only ``/dev/nvidia3``.

    ``dev_dir`` and ``load`` (name -> ctypes library or None) are where the answers come
    from; a caller passes others to ask about another machine's listing."""
    cuda = load("libcuda.so.1")
    if cuda is not None:
        n = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(n)) == _CUDA_SUCCESS:
            return n.value
    nvml = load("libnvidia-ml.so.1")
    if nvml is not None and nvml.nvmlInit_v2() == _NVML_SUCCESS:
        try:
            n = ctypes.c_uint(0)
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(n)) == _NVML_SUCCESS:
                return n.value
        finally:
            nvml.nvmlShutdown()
    try:
        return sum(1 for e in os.scandir(dev_dir) if _GPU_NODE.fullmatch(e.name))
    except OSError:
        return 0


def has_gpu(dev_dir: str = "/dev", load: Callable[[str], Any | None] = load_library) -> bool:
    """Whether this process can see an NVIDIA GPU (:func:`gpu_count`); NIXL's VRAM is
    offered only then."""
    return gpu_count(dev_dir, load) > 0


def local_memory_kinds(plugin_mem_types: list[set[str]], has_gpu: bool, device_memory: str) -> frozenset[str]:
    """The memory this agent registers: device memory (VRAM) only where every selected
    plugin moves it, this host has a GPU and the ``device_memory`` option does not say
    ``none`` (which also keeps UCX's cuda transports out of the list, so NIXL could not
    move it: the core refuses it at ``register`` instead of NIXL failing later)."""
    vram = all("VRAM_SEG" in m for m in plugin_mem_types) and has_gpu and device_memory != "none"
    return frozenset({"cpu", "cuda"}) if vram else frozenset({"cpu"})
