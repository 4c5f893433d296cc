"""bench/gpu_validate.py: refuses clearly without a GPU, and its flow works end to end.

Without CUDA it must exit 2 with one line saying why. ``--memory cpu`` runs the script's
whole flow (two processes, metadata swap, READ and WRITE, byte verification, table) on CPU
buffers over real ucx and nixl: that tests the script, not device memory. On a CUDA host
the real run is the last test here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_validate.py"


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and not getattr(torch.version, "hip", None)


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "backends"), str(ROOT / "vllm_adapter"), str(ROOT / "tools"),
         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.skipif(_cuda(), reason="CUDA is present: test_gpu_validate_on_cuda runs the real validation")
def test_without_cuda_exits_2_with_one_line_reason():
    out = _run()
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_validate: cannot validate CUDA device memory"), out.stderr
    assert "PASS" not in out.stdout


def test_cpu_self_test_moves_and_verifies_over_ucx_and_nixl():
    out = _run("--memory", "cpu", "--backends", "ucx,nixl", "--sizes-mib", "1,4", "--scatter", "64x16384",
               "--region-mib", "8", "--iters", "1", "--paths", "direct")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "validates NO device memory" in out.stdout
    for backend in ("ucx", "nixl"):
        for op in ("READ", "WRITE"):
            for case in ("1 MiB contiguous", "4 MiB contiguous", "64 x 16 KiB scattered"):
                assert f"PASS  {backend}: {op} {case} byte-exact" in out.stdout, out.stdout
    assert "14 passed, 0 failed" in out.stdout


def test_cpu_self_test_of_the_staged_path_over_ucx_and_nixl():
    """The staged rows (connector host staging's own copy code, HostStaging) by default next
    to the direct ones; on CPU buffers the 'device' copies are host-to-host but real: the
    mirrors are zeroed before each case, so a missing copy is a wrong byte."""
    out = _run("--memory", "cpu", "--backends", "ucx,nixl", "--sizes-mib", "1,4", "--scatter", "64x16384",
               "--region-mib", "8", "--iters", "1")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    for backend in ("ucx+staged", "nixl+staged"):
        assert f"PASS  {backend}: server registers cpu memory (staged through a host mirror)" in out.stdout
        for op in ("READ", "WRITE"):
            for case in ("1 MiB contiguous", "4 MiB contiguous", "64 x 16 KiB scattered"):
                assert f"PASS  {backend}: {op} {case} byte-exact" in out.stdout, out.stdout
    assert "28 passed, 0 failed" in out.stdout


def test_a_backend_that_cannot_be_opened_fails_the_run():
    out = _run("--memory", "cpu", "--backends", "no-such-backend", "--sizes-mib", "1", "--scatter", "4x4096",
               "--region-mib", "1", "--iters", "0")
    assert out.returncode == 1, f"{out.stdout}\n{out.stderr}"
    assert "FAIL  no-such-backend: register cpu memory" in out.stdout


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
def test_gpu_validate_on_cuda():
    out = _run(timeout=3600)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
