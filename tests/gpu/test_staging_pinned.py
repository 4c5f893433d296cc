"""The host mirror's size: one exact-size allocation, pinned in place, its real size logged.

torch's pinned allocator (used by ``pin_memory=True``) rounds every allocation up to a
power of two and keeps it cached: a 1.1 GiB per-layer mirror pinned 2 GiB. The mirror is
now one ordinary host allocation of exactly the planned size (each distinct device byte
range once, page-aligned), page-locked in place by :func:`pin_host_buffer` — the one
device call, which needs a CUDA runtime and so cannot run here. What runs here: the size
computation, the one-allocation layout, the log line, and what ``pin_host_buffer`` asks
of the CUDA runtime (given a recording stand-in of ``torch.cuda.cudart()``: the real one
exists only on a CUDA host, where tests/gpu/test_staging.py checks the mirror is pinned).
A device cache's copies go through a fixed pinned scratch in the same allocation (so the
pinned total is known at start-up): its sizing and slot reuse run here with host fences.
"""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
from kvtransport_vllm.config import ConnectorConfigError  # noqa: E402
from kvtransport_vllm.kv_layout import describe_kv_caches  # noqa: E402
from kvtransport_vllm.staging import (  # noqa: E402
    MIRROR_ALIGN,
    SCRATCH_BYTES,
    SCRATCH_SLOTS,
    HostFence,
    HostStaging,
    PinnedSlots,
    pin_host_buffer,
    plan_mirrors,
    scratch_slot_bytes,
)

NB = 8


def _round_up(n: int, a: int = MIRROR_ALIGN) -> int:
    return -(-n // a) * a


def _one_allocation(st: HostStaging) -> int:
    """The bytes of the one allocation every host view lies in (fails if there are several)."""
    storages = {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes() for h in st.host}
    assert len(storages) == 1, f"{len(storages)} host allocations for {len(st.host)} layers"
    (nbytes,) = storages.values()
    base = next(iter(storages))
    for h, lm in zip(st.host, st.layers):
        assert base <= h.data_ptr() and h.data_ptr() + lm.nbytes <= base + nbytes  # inside it
    return nbytes


def test_separate_layer_tensors_share_one_exact_allocation():
    # 2560 bytes per layer: each range is padded to a page, never to a power of two
    caches = {f"layers.{i}": torch.randn(NB, 2, 4, 10) for i in range(3)}
    layers = describe_kv_caches(caches, NB)
    st = HostStaging(layers)
    want = sum(_round_up(lm.nbytes) for lm in layers)
    assert want == 3 * 4096
    assert _one_allocation(st) == want == st.mirror.total_bytes == st.nbytes
    # each host view is laid out like its cache and starts on its own page
    for h, c in zip(st.host, caches.values()):
        assert h.shape == c.shape and h.stride() == c.stride()
        assert (h.data_ptr() - st.buffer.data_ptr()) % MIRROR_ALIGN == 0


def test_aliased_hybrid_layers_cost_their_distinct_bytes_once():
    pytest.importorskip("vllm")
    from .test_staging_hybrid import hybrid_groups, layer_groups, vllm_allocated

    groups = hybrid_groups()
    kv = vllm_allocated(groups, NB, 4)
    layers = describe_kv_caches(kv, NB)
    st = HostStaging(layers, layer_groups(groups, kv))
    device_bytes = next(iter(kv.values())).untyped_storage().nbytes()
    assert sum(lm.nbytes for lm in layers) == 2 * device_bytes  # per layer: each byte twice
    assert _one_allocation(st) == _round_up(device_bytes) == st.nbytes
    assert st.mirror.mirrored_bytes == device_bytes


def test_plan_merges_only_overlapping_or_touching_ranges_of_one_allocation():
    buf = torch.zeros(4 * NB * 64, dtype=torch.float32)
    a = buf[: NB * 64].view(NB, 64)  # bytes [0, 2048)
    b = buf[NB * 64: 2 * NB * 64].view(NB, 64)  # touches a
    c = buf[3 * NB * 64:].view(NB, 64)  # a gap before it
    plan = plan_mirrors(describe_kv_caches({"a": a, "b": b, "c": c, "a2": a}, NB))
    assert [r.nbytes for r in plan.ranges] == [2 * NB * 64 * 4, NB * 64 * 4]
    assert plan.layer_range == [0, 0, 1, 0]
    assert plan.total_bytes == _round_up(2 * NB * 64 * 4) + _round_up(NB * 64 * 4)


def test_the_log_line_reports_the_real_allocation():
    caches = {f"layers.{i}": torch.randn(NB, 2, 4, 10) for i in range(3)}
    st = HostStaging(describe_kv_caches(caches, NB))
    line = st.describe()
    assert f"({st.buffer.untyped_storage().nbytes()} bytes)" in line, line
    assert "3 distinct device byte range(s) of 3 layers" in line, line


class RecordingCudart:
    """Stand-in for torch.cuda.cudart() (no CUDA runtime here): records the calls."""

    def __init__(self, error: int = 0) -> None:
        self.error, self.calls = error, []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA runtime's name
        self.calls.append(("register", ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


def test_pin_registers_exactly_the_buffer_and_the_undo_unregisters_it():
    buf = torch.empty(3 * 4096 + 512, dtype=torch.uint8)  # not a power of two
    rt = RecordingCudart()
    undo = pin_host_buffer(buf, cudart=rt)
    assert rt.calls == [("register", buf.data_ptr(), 3 * 4096 + 512, 1)]  # 1: cudaHostRegisterPortable
    undo()
    assert rt.calls[-1] == ("unregister", buf.data_ptr())


def test_a_pin_failure_is_a_config_error_naming_the_fix():
    buf = torch.empty(8192, dtype=torch.uint8)
    with pytest.raises(ConnectorConfigError) as ei:
        pin_host_buffer(buf, cudart=RecordingCudart(error=2))
    msg = str(ei.value)
    assert "CUDA error 2" in msg and "memlock" in msg and "kv_buffer_device 'auto'" in msg, msg


def test_a_cpu_engines_mirror_is_not_pinned():
    calls = []
    caches = {"layers.0": torch.randn(NB, 2, 4, 10)}
    st = HostStaging(describe_kv_caches(caches, NB), pin=lambda buf: calls.append(buf) or (lambda: None))
    assert calls == [] and not st.on_device
    st.close()


# -- the copy scratch (a device cache only): bounded, reused once its copies are done ------
def test_scratch_slots_come_from_the_budget_and_hold_at_least_one_block():
    assert scratch_slot_bytes(64 << 10, 10 << 30) == SCRATCH_BYTES // SCRATCH_SLOTS  # a large cache: the budget
    assert scratch_slot_bytes(64 << 10, 1 << 20) == (1 << 20) // SCRATCH_SLOTS  # never more than the mirror
    assert scratch_slot_bytes(3 << 20, 1 << 20) == 3 << 20  # a slot holds the largest layer's block
    assert scratch_slot_bytes(5000, 4000) == 8192  # page-aligned


class CopyInFlight:
    """A device copy not done yet; done when waited for (records whether that wait ran
    inside the sync-check exemption)."""

    def __init__(self, inside) -> None:
        self.done, self.inside, self.waited_inside = False, inside, None

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited_inside = self.inside[0]
        self.done = True


def test_a_slot_is_reused_only_once_its_copies_are_done_and_their_rows_scattered():
    inside = [False]

    @contextlib.contextmanager
    def allowed():
        inside[0] = True
        yield
        inside[0] = False

    buf = torch.zeros(2 * 4096, dtype=torch.uint8)
    slots = PinnedSlots(buf, 2, allowed)
    settled = []
    a = slots.take()
    slow = CopyInFlight(inside)
    slots.give_back(a, slow, lambda: settled.append("a"))
    b = slots.take()
    slots.give_back(b, HostFence(done=True), lambda: settled.append("b"))
    assert (a, b) == (0, 1) and settled == []
    assert slots.take() == 0  # slot a again: its copy was waited for first, then its rows settled
    assert slow.done and slow.waited_inside is True and settled == ["a"]
    slots.drain()
    assert settled == ["a", "b"]  # b's copy was done: settled without a wait
    rows = slots.rows(1, (2, 3), torch.float32)
    assert rows.shape == (2, 3) and rows.data_ptr() == buf.data_ptr() + 4096  # the start of slot 1
