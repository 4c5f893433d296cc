"""Availability of the moriio backend: each requirement, the precise reason, the typed error.

Each requirement is tested on a described machine (HostFacts over a tmp file tree), and
the real machine's answer is checked end to end: ``kvt.available_backends()``, the
``kvtransport backends`` CLI, ``kvt.open`` and the constructor all give the same reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvtransport as kvt
from kvtransport.errors import BackendUnavailableError
from kvtransport_moriio.backend import MoriioBackend, using_mori_module
from kvtransport_moriio.probe import HostFacts, check_requirements


def good_machine(root: Path, **over) -> HostFacts:
    (root / "opt/rocm/.info").mkdir(parents=True, exist_ok=True)
    (root / "opt/rocm/.info/version").write_text("7.0.2-56\n")
    (root / "dev").mkdir(exist_ok=True)
    (root / "dev/kfd").write_text("")
    (root / "sys/class/infiniband/mlx5_0").mkdir(parents=True, exist_ok=True)
    facts = HostFacts(python=(3, 12), root=str(root), rocm_path="/opt/rocm",
                      mori_installed=lambda: True, load_library=lambda name: name == "libamdhip64.so.7")
    for k, v in over.items():
        setattr(facts, k, v)
    return facts


def test_a_complete_machine_is_usable(tmp_path):
    assert check_requirements(good_machine(tmp_path)).usable
    assert check_requirements(good_machine(tmp_path, python=(3, 10))).usable


@pytest.mark.parametrize("py", [(3, 11), (3, 13), (3, 9)])
def test_python_without_wheels_is_named(tmp_path, py):
    av = check_requirements(good_machine(tmp_path, python=py))
    assert not av.usable
    assert av.reason == f"amd-mori publishes wheels only for CPython 3.10 and 3.12; this is Python {py[0]}.{py[1]}"
    assert "3.10 or 3.12" in av.install_hint


def test_missing_mori_is_named(tmp_path):
    av = check_requirements(good_machine(tmp_path, mori_installed=lambda: False))
    assert not av.usable and av.reason.startswith("amd-mori is not installed")
    assert "kvtransport[moriio]" in av.install_hint


def test_old_rocm_is_named(tmp_path):
    facts = good_machine(tmp_path)
    (tmp_path / "opt/rocm/.info/version").write_text("6.4.1-120\n")
    av = check_requirements(facts)
    assert not av.usable and "needs ROCm 7; found ROCm 6.4.1-120" in av.reason


def test_missing_hip_runtime_is_named(tmp_path):
    facts = good_machine(tmp_path, load_library=lambda name: False)
    (tmp_path / "opt/rocm/.info/version").unlink()
    av = check_requirements(facts)
    assert not av.usable and "libamdhip64.so.7 cannot be loaded" in av.reason


def test_missing_gpu_driver_is_named(tmp_path):
    facts = good_machine(tmp_path)
    (tmp_path / "dev/kfd").unlink()
    av = check_requirements(facts)
    assert not av.usable and "/dev/kfd is missing" in av.reason


def test_missing_rdma_device_is_named_unless_xgmi(tmp_path):
    facts = good_machine(tmp_path)
    (tmp_path / "sys/class/infiniband/mlx5_0").rmdir()
    av = check_requirements(facts)
    assert not av.usable and "needs an RDMA device: /sys/class/infiniband is empty" in av.reason
    assert check_requirements(facts, need_rdma=False).usable


def test_first_failing_requirement_wins(tmp_path):
    facts = good_machine(tmp_path, python=(3, 11), mori_installed=lambda: False)
    assert "Python 3.11" in check_requirements(facts).reason


# --------------------------------------------------------------------------- this machine
def _real_reason() -> str:
    av = MoriioBackend.probe()
    if av.usable:
        pytest.skip("moriio is usable on this machine; the unavailable path cannot be observed here")
    return av.reason


def test_available_backends_reports_moriio_with_the_precise_reason():
    reason = _real_reason()
    (info,) = [i for i in kvt.available_backends() if i.name == "moriio"]
    assert not info.usable and info.reason == reason and info.install_hint


def test_kvtransport_backends_cli_shows_the_reason():
    reason = _real_reason()
    out = subprocess.run([sys.executable, "-m", "kvtransport.cli", "backends"], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0 and "No module named kvtransport.cli" in out.stderr:
        pytest.skip("kvtransport.cli is not there yet")
    text = " ".join((out.stdout + out.stderr).split())  # rich may wrap long lines
    assert "moriio" in text
    # The table may wrap the reason across cells; every word of it must be shown in order.
    words = reason.split()
    pos = 0
    for w in words:
        found = text.find(w, pos)
        assert found >= 0, f"{w!r} of the reason missing from `kvtransport backends` output:\n{out.stdout}"
        pos = found + len(w)


def test_open_and_constructor_raise_typed_error_with_the_same_text():
    reason = _real_reason()
    with pytest.raises(BackendUnavailableError) as e1:
        kvt.open("moriio", name="x")
    with pytest.raises(BackendUnavailableError) as e2:
        MoriioBackend("x", {})
    assert e1.value.reason == e2.value.reason == reason
    assert reason in str(e1.value) and str(e1.value) == str(e2.value)


def test_injected_module_seam_does_not_leak():
    from .fake_mori_io import make_fake_mori_io

    before = MoriioBackend.probe()
    with using_mori_module(make_fake_mori_io()):
        assert MoriioBackend.probe().usable
    assert MoriioBackend.probe() == before


def test_xgmi_only_env_drops_the_rdma_requirement(monkeypatch):
    from kvtransport_moriio import backend as be_mod

    seen = []
    monkeypatch.setattr(be_mod._probe, "check_requirements",
                        lambda facts=None, *, need_rdma=True: seen.append(need_rdma) or be_mod.Availability(False, "x"))
    MoriioBackend.probe()
    monkeypatch.setenv("KVT_MORIIO_XGMI_ONLY", "1")
    MoriioBackend.probe()
    assert seen == [True, False]
