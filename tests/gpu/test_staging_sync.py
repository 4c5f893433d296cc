"""Device ordering that vLLM's sync check accepts, and loads reported by a polled fence.

With ``VLLM_GPU_SYNC_CHECK=error`` vLLM raises on any host-device synchronisation inside
``execute_model`` (where the connector's hooks run) unless it is inside
``gpu_sync_allowed()``, and on non-blocking copies from pageable host memory. The
deliberate waits of the connector (the stream before a hold is offered, the staged
device -> host copy) run inside vLLM's ``gpu_sync_allowed`` (the installed vLLM 0.32 has
it: it is the real context manager here); host -> device copies read pinned memory and
are never waited for: ``after_receive`` returns a fence and ``get_finished`` reports the
load only once that fence is ready, so the engine thread never waits for the forward in
flight.

No GPU here: the stream is a recording stand-in (as in test_ordering.py), and the fence
that is "not ready yet" is the host implementation (:class:`HostFence`) held by a test
device that finishes its copy when the test says so. The CUDA test at the end runs the
real device path under vLLM's armed check on a CUDA host.
"""
from __future__ import annotations

import os
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
from kvtransport_vllm.config import ConnectorConfig  # noqa: E402
from kvtransport_vllm.kv_layout import describe_kv_caches  # noqa: E402
from kvtransport_vllm.staging import (  # noqa: E402
    DirectDeviceKV,
    HostFence,
    KVDevice,
    make_kv_device,
    vllm_sync_allowed,
)
from kvtransport_vllm.worker import KVTransportWorker  # noqa: E402

os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")


@pytest.fixture
def sync_check_error(monkeypatch):
    """vLLM's sync check in "error" mode (the module's documented test knob: the env var
    is read once at import)."""
    gsd = pytest.importorskip("vllm.utils.gpu_sync_debug")
    monkeypatch.setattr(gsd, "_SYNC_CHECK_MODE", "error")
    return gsd


def test_the_exemption_is_vllms_own_when_vllm_has_it(monkeypatch):
    gsd = pytest.importorskip("vllm.utils.gpu_sync_debug")
    assert vllm_sync_allowed() is gsd.gpu_sync_allowed
    monkeypatch.setitem(sys.modules, "vllm.utils.gpu_sync_debug", None)  # a vLLM without it
    with vllm_sync_allowed()():
        pass


def test_the_stream_wait_before_holds_runs_inside_vllms_exemption(sync_check_error):
    depth = []

    class Stream:
        def synchronize(self):
            depth.append(sync_check_error._allow_depth.get())

    d = DirectDeviceKV("cuda:0", stream_of=lambda dev: Stream())
    d.before_send([])
    assert depth == []  # nothing to send: no wait at all
    d.before_send([4, 5])
    assert depth == [1], "the synchronize ran outside gpu_sync_allowed(): VLLM_GPU_SYNC_CHECK=error raises"


def test_host_fence_reports_not_ready_then_ready():
    f = HostFence()
    assert not f.query()
    t = threading.Thread(target=f.set)  # the host thread that does the work says when it is done
    t.start()
    f.synchronize()
    t.join()
    assert f.query()
    assert HostFence(done=True).query()


def test_a_cpu_caches_staged_copy_is_done_when_returned():
    caches = {"layers.0": torch.randn(8, 2, 4, 10)}
    st = make_kv_device(describe_kv_caches(caches, 8), "cpu")
    for h in st.host:
        h.fill_(5.0)
    fence = st.after_receive([3])
    assert fence.query()
    assert bool((caches["layers.0"][3] == 5.0).all())


class CopyInFlight(KVDevice):
    """A device whose host -> device copy has been enqueued but has not completed: its
    fence becomes ready when the test (the device) finishes the copy."""

    def __init__(self) -> None:
        self.fences: list[HostFence] = []
        self.copied: list[tuple[list[int], list[int]]] = []

    def after_receive(self, block_ids, group_sizes=()):
        self.copied.append((list(block_ids), list(group_sizes)))
        self.fences.append(HostFence())
        return self.fences[-1]


def _staged_consumer() -> KVTransportWorker:
    cfg = ConnectorConfig.from_extra("kv_consumer", "sync-test", {"backend": "loopback", "mode": "read",
                                                                  "side_channel_port": 1,
                                                                  "kv_buffer_device": "cpu"})
    return KVTransportWorker(cfg, 4, 8, "float32")


def test_a_staged_load_is_reported_once_its_copy_is_done_never_waited_for():
    w = _staged_consumer()
    dev = CopyInFlight()
    w.kv_device = dev
    w._staged_loads = {"r": ([3, 4, 1], [2, 1]), "other": ([6], [])}
    with w.ctx.lock:
        w.consumer.done_recving = {"r"}  # the transport finished r's bytes in the host buffer
    assert w.get_finished(set()) == (None, None)  # copy in flight: not reported, not waited for
    assert dev.copied == [([3, 4, 1], [2, 1])]  # enqueued once, with its groups
    assert w.get_finished(set()) == (None, None)  # still in flight
    dev.fences[0].set()  # the device completes the copy
    assert w.get_finished(set()) == (None, {"r"})
    assert w.get_finished(set()) == (None, None)  # reported exactly once
    assert w._staged_loads == {"other": ([6], [])}


def test_an_aborted_load_whose_copy_is_in_flight_is_still_reported_once():
    """vLLM keeps an aborted request that waits for remote KV (and its blocks) until the
    connector reports it: reported when the copy is done, so nothing writes freed blocks."""
    w = _staged_consumer()
    dev = CopyInFlight()
    w.kv_device = dev
    w._staged_loads = {"r": ([2], [])}
    with w.ctx.lock:
        w.consumer.done_recving = {"r"}
    assert w.get_finished(set()) == (None, None)
    assert w.get_finished({"r"}) == (None, None)  # aborted while copying
    dev.fences[0].set()
    assert w.get_finished(set()) == (None, {"r"})


def _cuda() -> bool:
    return torch.cuda.is_available() and not getattr(torch.version, "hip", None)


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
def test_device_paths_pass_vllms_armed_sync_check_on_cuda(sync_check_error, monkeypatch):
    """On a CUDA host: vLLM's check armed in "error" mode, as around execute_model; the
    staged copies in both directions and the stream wait raise nothing, and an
    unexempted synchronize does (the check is really armed)."""
    gsd = sync_check_error
    monkeypatch.setattr(gsd, "_sync_check_enabled", True)
    for name, fn in (("to", gsd._checked_to), ("cuda", gsd._checked_cuda), ("copy_", gsd._checked_copy_)):
        monkeypatch.setattr(torch.Tensor, name, fn)  # vLLM's implicit-sync copy checks, undone after
    caches = {f"layers.{i}": torch.randn(8, 2, 4, 16, device="cuda") for i in range(2)}
    layers = describe_kv_caches(caches, 8)
    st = make_kv_device(layers, "cpu")
    direct = make_kv_device(layers, "auto")
    for h in st.host:
        h.copy_(torch.randn(h.shape))  # bytes "landed" in the mirror (it starts uninitialised)
    with gsd._checked_region("error"):
        with pytest.raises(RuntimeError):
            torch.cuda.current_stream().synchronize()
        direct.before_send([1])
        st.before_send([2, 5])
        fence = st.after_receive([1, 7])
    fence.synchronize()
    for lm, h, c in zip(st.layers, st.host, caches.values()):
        assert torch.equal(c.cpu()[[1, 7]], h[[1, 7]])
        assert torch.equal(c.cpu()[[2, 5]], h[[2, 5]])
    st.close()
