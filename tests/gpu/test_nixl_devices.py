"""The nixl backend on GPU hosts: finding the GPUs, and UCX's cuda transports in its list.

* A container keeps the physical device number: a pod given GPU 3 sees ``/dev/nvidia3`` and
  no ``/dev/nvidia0``; VRAM must still be offered. Listings are directories made here and
  passed in, together with the library loader (no NVIDIA library: the device-node answer).
  The CUDA-driver and NVML answers are checked against FAKE library objects (they test our
  order of questions, not NVIDIA's libraries), since this host has neither.
* NIXL's UCX plugin registers VRAM in a UCP context, which knows CUDA memory only when the
  transport list selects UCX's cuda transports: the ``tls`` option gets them added.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

import kvtransport as kvt
from kvtransport import errors
from kvtransport.registry import available_backends

pytest.importorskip("kvtransport_nixl")
from kvtransport_nixl import probe as _probe  # noqa: E402
from kvtransport_nixl.options import parse_options  # noqa: E402

CUDA_ERROR_NOT_INITIALIZED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9


def _no_library(name: str) -> None:
    return None


def _listing(tmp_path: Path, *names: str) -> str:
    """A /dev-like directory holding ``names`` (files; ``nvidia-caps`` a directory, as on hosts)."""
    for n in names:
        (tmp_path / n).mkdir() if n == "nvidia-caps" else (tmp_path / n).touch()
    return str(tmp_path)


CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia-caps")


def test_a_pod_given_gpu_3_has_vram(tmp_path):
    dev = _listing(tmp_path, *CONTROL_NODES, "nvidia3", "null", "shm")
    assert _probe.gpu_count(dev, _no_library) == 1
    assert _probe.has_gpu(dev, _no_library)


def test_control_nodes_alone_are_no_gpu(tmp_path):
    dev = _listing(tmp_path, *CONTROL_NODES, "null")
    assert _probe.gpu_count(dev, _no_library) == 0 and not _probe.has_gpu(dev, _no_library)
    assert _probe.gpu_count(str(tmp_path / "missing"), _no_library) == 0


def test_every_device_node_counts(tmp_path):
    assert _probe.gpu_count(_listing(tmp_path, "nvidiactl", "nvidia2", "nvidia5", "nvidia12"), _no_library) == 3


def test_vram_is_offered_for_a_pod_given_gpu_3_real_nixl_plugin(tmp_path):
    """The backend offers VRAM when every plugin handles VRAM_SEG and a GPU is found; the
    real NIXL UCX plugin handles it, and the listing with only nvidia3 finds one."""
    info = {i.name: i for i in available_backends()}.get("nixl")
    if info is None or not info.usable:
        pytest.skip(f"backend nixl is not usable here: {info and info.reason}")
    _, mem_types = _probe.plugin_info().describe("UCX")
    dev = _listing(tmp_path, "nvidiactl", "nvidia3")
    assert "VRAM_SEG" in mem_types and _probe.has_gpu(dev, _no_library)


class FakeCuda:
    """FAKE libcuda.so.1: ``cuDeviceGetCount`` as before/after the process initialised CUDA."""

    def __init__(self, count: int | None) -> None:
        self.count = count  # None: CUDA not initialised in this process

    def cuDeviceGetCount(self, ref) -> int:
        if self.count is None:
            return CUDA_ERROR_NOT_INITIALIZED
        ref._obj.value = self.count
        return 0


class FakeNvml:
    """FAKE libnvidia-ml.so.1 (init / count / shutdown, balanced)."""

    def __init__(self, count: int | None) -> None:
        self.count, self.open = count, 0

    def nvmlInit_v2(self) -> int:
        if self.count is None:
            return NVML_ERROR_DRIVER_NOT_LOADED
        self.open += 1
        return 0

    def nvmlDeviceGetCount_v2(self, ref) -> int:
        ref._obj.value = self.count
        return 0

    def nvmlShutdown(self) -> int:
        self.open -= 1
        return 0


def _loader(cuda=None, nvml=None):
    return {"libcuda.so.1": cuda, "libnvidia-ml.so.1": nvml}.get


def test_question_order_fake_libraries(tmp_path):
    dev = _listing(tmp_path, "nvidiactl", "nvidia0", "nvidia1", "nvidia2", "nvidia3")
    # CUDA already initialised here (CUDA_VISIBLE_DEVICES=1): its count wins
    assert _probe.gpu_count(dev, _loader(FakeCuda(1), FakeNvml(4))) == 1
    # not initialised: we do not initialise it; NVML answers (and is shut down again)
    nvml = FakeNvml(4)
    assert _probe.gpu_count(dev, _loader(FakeCuda(None), nvml)) == 4 and nvml.open == 0
    # NVML without a loaded driver: the device nodes
    assert _probe.gpu_count(dev, _loader(FakeCuda(None), FakeNvml(None))) == 4
    pod = tmp_path / "pod"
    pod.mkdir()
    assert _probe.gpu_count(_listing(pod, "nvidia3"), _loader(None, FakeNvml(None))) == 1


def test_the_real_loader_answers_none_for_a_missing_library():
    assert _probe.load_library("libkvt-no-such-library.so.1") is None
    assert isinstance(_probe.load_library("libc.so.6"), ctypes.CDLL)


# -- UCX's cuda transports in the nixl backend's tls ---------------------------------------------
GPU_HERE, NO_GPU_HERE = (lambda: frozenset({"cuda"})), (lambda: frozenset())


@pytest.mark.parametrize("tls,expected", [("tcp", "tcp,cuda"), ("cma+tcp", "cma,tcp,cuda"),
                                          ("shm", "sysv,posix,cma,cuda")])
def test_tls_gets_the_cuda_transports_for_device_memory(tls, expected):
    for opts in (parse_options({"tls": tls, "device_memory": "cuda"}, environ={}, kinds_here=NO_GPU_HERE),
                 parse_options({"tls": tls}, environ={}, kinds_here=GPU_HERE)):
        assert opts.ucx_env["TLS"] == expected
    # the error-handling choice is the user's list's: shared memory keeps "none"
    plain = parse_options({"tls": tls, "device_memory": "none"}, environ={}, kinds_here=GPU_HERE)
    assert plain.ucx_env["TLS"] == expected.removesuffix(",cuda")
    assert opts.plugin_params == plain.plugin_params


def test_auto_keeps_the_list_on_a_gpu_less_host(tmp_path):
    no_gpu = lambda: frozenset({"cuda"}) if _probe.has_gpu(_listing(tmp_path, "nvidiactl"), _no_library) \
        else frozenset()  # noqa: E731
    assert parse_options({"tls": "tcp"}, environ={}, kinds_here=no_gpu).ucx_env["TLS"] == "tcp"


def test_auto_adds_them_for_a_pod_given_gpu_3(tmp_path):
    gpu3 = lambda: frozenset({"cuda"}) if _probe.has_gpu(_listing(tmp_path, "nvidiactl", "nvidia3"), _no_library) \
        else frozenset()  # noqa: E731
    assert parse_options({"tls": "tcp"}, environ={}, kinds_here=gpu3).ucx_env["TLS"] == "tcp,cuda"


@pytest.mark.parametrize("env", ["tcp", "^cuda"])
def test_a_user_ucx_tls_without_cuda_is_refused_naming_it(monkeypatch, env):
    info = {i.name: i for i in available_backends()}.get("nixl")
    if info is None or not info.usable:
        pytest.skip(f"backend nixl is not usable here: {info and info.reason}")
    monkeypatch.setenv("UCX_TLS", env)
    with pytest.raises(errors.BackendOptionError) as ei:
        kvt.open("nixl", device_memory="cuda")
    msg = str(ei.value)
    assert msg.startswith("nixl backend:") and f"UCX_TLS={env!r}" in msg and "unset UCX_TLS" in msg, msg


def test_device_memory_is_checked():
    with pytest.raises(errors.BackendOptionError, match="device_memory must be one of"):
        parse_options({"device_memory": "rocm"}, environ={})


@pytest.mark.parametrize("mems, gpu, device_memory, kinds", [
    ([{"DRAM_SEG", "VRAM_SEG"}], True, "auto", {"cpu", "cuda"}),
    ([{"DRAM_SEG", "VRAM_SEG"}], True, "cuda", {"cpu", "cuda"}),
    ([{"DRAM_SEG", "VRAM_SEG"}], True, "none", {"cpu"}),      # the option keeps device memory out
    ([{"DRAM_SEG", "VRAM_SEG"}], False, "auto", {"cpu"}),     # no GPU on this host
    ([{"DRAM_SEG", "VRAM_SEG"}, {"DRAM_SEG"}], True, "auto", {"cpu"}),  # one plugin without VRAM
])
def test_local_memory_kinds_follow_plugins_gpu_and_option(mems, gpu, device_memory, kinds):
    from kvtransport_nixl.probe import local_memory_kinds

    assert local_memory_kinds(mems, gpu, device_memory) == frozenset(kinds)
