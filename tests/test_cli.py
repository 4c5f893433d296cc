"""The CLI as a user runs it: ``kvtransport backends`` and ``kvtransport bench``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "kvtransport.cli"]


def test_backends_lists_every_entry_point_with_reasons():
    out = subprocess.run(CLI + ["backends", "--json"], capture_output=True, text=True, check=True, timeout=120)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert {"loopback", "ucx", "moriio"} <= set(rows)
    assert rows["loopback"]["usable"] is True
    assert rows["loopback"]["entry_point"] == "kvtransport_loopback.backend:LoopbackBackend"
    if not rows["moriio"]["usable"]:
        assert rows["moriio"]["reason"]  # never unusable without saying why
    table = subprocess.run(CLI + ["backends"], capture_output=True, text=True, check=True, timeout=120).stdout
    assert "loopback" in table and "moriio" in table and "ucx" in table


@pytest.mark.parametrize("mode", ["both"])
def test_bench_moves_and_verifies_every_byte(tmp_path, mode):
    plot = tmp_path / "bench.png"
    out = subprocess.run(
        CLI + ["bench", "--layers", "4", "--num-blocks", "32", "--block-bytes", "8192",
               "--blocks-per-request", "8", "--requests", "3", "--warmup", "1", "--mode", mode,
               "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    by_mode = {r["mode"]: r for r in res["results"]}
    assert set(by_mode) == {"read", "write"}
    for r in by_mode.values():
        assert r["failed"] == 0
        assert r["verified_blocks"] == 3 * 8 * 2 * 4  # requests x blocks x (K,V) x layers
        assert r["gbps"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "secret" not in res["config"]


def test_bench_refuses_bad_arguments():
    out = subprocess.run(CLI + ["bench", "--num-blocks", "4", "--blocks-per-request", "8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "blocks-per-request" in out.stderr
    out = subprocess.run(CLI + ["bench", "--backend", "nope"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "installed backends" in out.stderr


def test_bench_plot_without_matplotlib_fails_before_the_run(tmp_path):
    """``--plot`` with matplotlib missing stops at once, naming the install, before any
    process starts (no banner, no picture), instead of failing after the measurement."""
    blocked = tmp_path / "blocked"
    (blocked / "matplotlib").mkdir(parents=True)
    (blocked / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")])))
    plot = tmp_path / "out.png"
    out = subprocess.run(CLI + ["bench", "--plot", str(plot), "--json"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "kvtransport[plot]" in out.stderr and "matplotlib hidden by the test" in out.stderr
    assert "kvtransport bench" not in out.stderr + out.stdout  # the run's banner: never started
    assert out.stdout == "" and not plot.exists()


def test_bench_job_is_not_part_of_the_core_package():
    """The bench job lives in ``kvtransport_bench``; importing the library or its CLI
    does not load it (the CLI imports it only for ``bench``)."""
    code = ("import sys, importlib.util, kvtransport, kvtransport.cli; "
            "assert 'kvtransport_bench' not in sys.modules, 'core imported the bench job'; "
            "assert importlib.util.find_spec('kvtransport.bench_job') is None; "
            "import kvtransport_bench; print(sorted(kvtransport_bench.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['BenchConfig', 'ModeResult', 'run_bench']"
