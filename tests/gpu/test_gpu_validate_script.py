"""bench/gpu_validate.py: refuses clearly without a GPU, and its flow works end to end.

Without CUDA it must exit 2 with one line saying why. ``--memory cpu`` runs the script's
whole flow (separate processes, metadata swap, READ and WRITE, byte verification of the
first and the last timed transfer, table) on CPU buffers over real ucx and nixl: that tests
the script, not device memory. Beside each row the script prints raw NIXL's GB/s (NIXL's
own API in two processes of its own, DRAM here); the tests check that column holds a
measured number, that a byte mismatch in that anchor path -- in its first or its last timed
transfer -- is reported and fails the run, that its agents are released, and that without
NIXL the column says why. The staged rows include two KV cache groups aliasing one cache.
On a CUDA host the real run is the last test here.
"""
from __future__ import annotations

import importlib.util
import os
import re
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


def _run(*args: str, timeout: float = 600, first_path: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        ([first_path] if first_path else [])
        + [str(ROOT), str(ROOT / "backends"), str(ROOT / "vllm_adapter"), str(ROOT / "tools"),
           env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _script():
    """The script as a module (its functions, not a copy of them)."""
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_NUM = r"(\d+\.\d+)"


def _row(stdout: str, backend: str, op: str, case: str) -> list[str]:
    """The table row's cells after the case name: MiB, GB/s, ms, raw NIXL GB/s, ours/raw."""
    for line in stdout.splitlines():
        m = re.fullmatch(rf"{re.escape(backend)}\s+{op}\s+{re.escape(case)}\s+(.*)", line.strip())
        if m:
            return m.group(1).split()
    raise AssertionError(f"no table row for {backend} {op} {case}:\n{stdout}")


def _assert_raw_column_measured(stdout: str, backend: str, op: str, case: str) -> None:
    """raw NIXL GB/s is a positive number and ours/raw is our GB/s divided by it."""
    cells = _row(stdout, backend, op, case)
    assert len(cells) == 5, cells
    ours, raw, ratio = float(cells[1]), cells[3], cells[4]
    assert re.fullmatch(_NUM, raw) and float(raw) > 0, f"raw NIXL cell {raw!r} in {cells}"
    assert re.fullmatch(_NUM, ratio), f"ratio cell {ratio!r} in {cells}"
    # both cells are printed rounded to 2 decimals: compare within that rounding
    lo, hi = (ours - 0.005) / (float(raw) + 0.005), (ours + 0.005) / max(float(raw) - 0.005, 1e-9)
    assert lo - 0.005 <= float(ratio) <= hi + 0.005, cells


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
    assert "26 passed, 0 failed" in out.stdout
    # the raw-NIXL anchor: its own byte checks passed on buffers like ours (DRAM), and every
    # row shows its GB/s and the ratio beside ours
    for backend in ("ucx", "nixl"):
        for op in ("READ", "WRITE"):
            for case in ("1 MiB contiguous", "4 MiB contiguous", "64 x 16 KiB scattered"):
                for check in ("byte-exact", "last timed round byte-exact"):
                    assert f"PASS  {backend}: {op} {case} {check}" in out.stdout, out.stdout
                    assert f"PASS  raw NIXL@{backend}: {op} {case} {check}" in out.stdout, out.stdout
                _assert_raw_column_measured(out.stdout, backend, op, case)
    assert "raw NIXL anchor: 24 passed, 0 failed" in out.stdout
    assert "raw NIXL n/a" not in out.stdout


def test_a_byte_mismatch_in_the_raw_nixl_path_is_reported():
    """--anchor-fault short makes the raw-NIXL transfers move only half of every range (real
    NIXL, real transfers); the anchor's byte check must say so, fail the run, and leave no
    number in its column, while our own rows still pass."""
    out = _run("--memory", "cpu", "--backends", "nixl", "--sizes-mib", "1", "--scatter", "64x16384",
               "--region-mib", "8", "--iters", "1", "--paths", "direct", "--anchor-fault", "short")
    assert out.returncode == 1, f"{out.stdout}\n{out.stderr}"
    for op in ("READ", "WRITE"):
        for case, nbytes in (("1 MiB contiguous", 1 << 20), ("64 x 16 KiB scattered", 64 * 16384)):
            assert f"PASS  nixl: {op} {case} byte-exact" in out.stdout, out.stdout
            m = re.search(rf"FAIL  raw NIXL@nixl: {op} {re.escape(case)} byte-exact  \d+ bytes to move, "
                          rf"(\d+) wrong in the whole buffer", out.stdout)
            assert m, out.stdout
            # half of every range was not moved; the two patterns differ in ~255/256 of those bytes
            assert int(m.group(1)) > nbytes // 4, m.group(0)
            cells = _row(out.stdout, "nixl", op, case)
            assert cells[3:] == ["FAIL", "-"], cells
    assert "9 passed, 0 failed" in out.stdout
    assert "raw NIXL anchor: 0 passed, 4 failed" in out.stdout


def test_a_wrong_last_timed_round_is_reported_for_ours_and_raw_nixl():
    """Hidden faults make our timed rounds and raw NIXL's move only half of every range (real
    transfers); the first transfers are right, so only the check of the last timed round,
    run on refilled buffers, can see it: it must fail the run for both, row by row."""
    out = _run("--memory", "cpu", "--backends", "nixl", "--sizes-mib", "1", "--scatter", "64x16384",
               "--region-mib", "8", "--iters", "2", "--paths", "direct", "--fault", "short-timed",
               "--anchor-fault", "short-timed")
    assert out.returncode == 1, f"{out.stdout}\n{out.stderr}"
    for op in ("READ", "WRITE"):
        for case, nbytes in (("1 MiB contiguous", 1 << 20), ("64 x 16 KiB scattered", 64 * 16384)):
            assert f"PASS  nixl: {op} {case} byte-exact" in out.stdout, out.stdout
            assert f"PASS  raw NIXL@nixl: {op} {case} byte-exact" in out.stdout, out.stdout
            for who, verb in (("nixl", "moved"), ("raw NIXL@nixl", "to move")):
                m = re.search(rf"FAIL  {re.escape(who)}: {op} {re.escape(case)} last timed round byte-exact  "
                              rf"\d+ bytes {verb}, (\d+) wrong in the whole buffer", out.stdout)
                assert m and int(m.group(1)) > nbytes // 4, out.stdout
            assert _row(out.stdout, "nixl", op, case)[3:] == ["FAIL", "-"]
    assert "5 passed, 4 failed" in out.stdout
    assert "raw NIXL anchor: 4 passed, 4 failed" in out.stdout


def test_raw_nixl_runs_in_processes_of_its_own_and_releases_its_agents():
    """The anchor's two agents live in two processes that are neither ours; at the end each
    is released (remote agent, registration, agent), which joins NIXL's progress thread."""
    out = _run("--memory", "cpu", "--backends", "ucx", "--sizes-mib", "1", "--scatter", "4x16384",
               "--region-mib", "2", "--iters", "1", "--paths", "direct")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    m = re.search(r"processes: ours (\d+) \(client\) and (\d+) \(server\); raw NIXL anchor (\d+) \(client\) "
                  r"and (\d+) \(server\)", out.stdout)
    assert m and len(set(m.groups())) == 4, out.stdout
    for side, pid in (("client", m.group(3)), ("server", m.group(4))):
        r = re.search(rf"raw-NIXL anchor {side} \(pid {pid}\): agent released, threads (\d+) -> (\d+)", out.stdout)
        assert r, out.stdout
        assert int(r.group(2)) < int(r.group(1)), r.group(0)


def test_without_nixl_the_raw_column_says_why(tmp_path):
    """NIXL hidden from the script (import-blocking stand-ins for its module names, first on
    the path): ucx still validates and passes; the raw-NIXL column reads n/a and a line
    under the table gives the reason."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl_rocm", "nixl"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    out = _run("--memory", "cpu", "--backends", "ucx", "--sizes-mib", "1", "--scatter", "64x16384",
               "--region-mib", "8", "--iters", "1", "--paths", "direct", first_path=str(tmp_path))
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "9 passed, 0 failed" in out.stdout
    for op in ("READ", "WRITE"):
        for case in ("1 MiB contiguous", "64 x 16 KiB scattered"):
            assert _row(out.stdout, "ucx", op, case)[3:] == ["n/a", "-"]
    assert re.search(r"raw NIXL n/a: server: NIXL's Python API is not installed .*hidden by the test",
                     out.stdout), out.stdout
    assert "raw NIXL anchor: 0 passed, 0 failed" in out.stdout


def test_cpu_self_test_of_the_staged_paths_over_ucx_and_nixl():
    """The staged rows (connector host staging's own copy code, HostStaging), one KV cache
    group and two groups aliasing one cache (a hybrid model's allocation, the moved blocks
    split between the groups); on CPU buffers the 'device' copies are host-to-host but real:
    the mirrors are zeroed before each case, so a missing copy, or one group's layer copying
    rows the transport never filled over the other group's blocks, is a wrong byte."""
    out = _run("--memory", "cpu", "--backends", "ucx,nixl", "--sizes-mib", "1", "--scatter", "64x16384",
               "--region-mib", "8", "--iters", "1", "--paths", "staged,aliased")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    for backend in ("ucx", "nixl"):
        assert f"PASS  {backend}+staged: server registers cpu memory (staged through a host mirror)" in out.stdout
        assert (f"PASS  {backend}+aliased: server registers cpu memory (staged, two KV cache groups aliasing "
                "the cache)") in out.stdout
        for row in (f"{backend}+staged", f"{backend}+aliased"):
            for op in ("READ", "WRITE"):
                for case in ("1 MiB contiguous", "64 x 16 KiB scattered"):
                    assert f"PASS  {row}: {op} {case} byte-exact" in out.stdout, out.stdout
                    assert f"PASS  {row}: {op} {case} last timed round byte-exact" in out.stdout, out.stdout
                    # staged rows too: raw NIXL moved a buffer like the device-side one directly
                    _assert_raw_column_measured(out.stdout, row, op, case)
    assert "36 passed, 0 failed" in out.stdout
    assert "raw NIXL anchor: 32 passed, 0 failed" in out.stdout


def test_placement_is_cross_gpu_when_two_gpus_exist():
    placement = _script().placement
    assert placement(1, "auto") == (0, 0)
    assert placement(2, "auto") == (0, 1)
    assert placement(8, "same") == (0, 0)
    assert placement(2, "cross") == (0, 1)
    with pytest.raises(SystemExit, match="--placement cross needs two GPUs; this host has 1"):
        placement(1, "cross")


def test_a_backend_that_cannot_be_opened_fails_the_run():
    out = _run("--memory", "cpu", "--backends", "no-such-backend", "--sizes-mib", "1", "--scatter", "4x4096",
               "--region-mib", "1", "--iters", "0")
    assert out.returncode == 1, f"{out.stdout}\n{out.stderr}"
    assert "FAIL  no-such-backend: register cpu memory" in out.stdout


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
def test_gpu_validate_on_cuda():
    out = _run(timeout=3600)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
