"""bench/moriio_validate.py runs end to end (both roles, one process) on the FAKE mori.io.

This tests the script a hardware user will run: argument handling, the metadata
exchange, each check and the throughput table. It validates no hardware, and the script
says so in its output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtransport.testing.ports import free_port_range

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: one from that range can be taken by
    any outgoing connection before the server binds it."""
    return free_port_range(1)


def test_validate_script_all_checks_pass_on_fake_mori(tmp_path):
    out_json = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "bench/moriio_validate.py", "--fake-mori", "--port", str(_free_port()),
         "--region-mb", "4", "--iters", "1", "--block-bytes", "4096,65536", "--json", str(out_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAKE mori.io" in proc.stdout and "validates NO hardware" in proc.stdout
    assert "4 passed, 0 failed" in proc.stdout
    import json

    res = json.loads(out_json.read_text())
    assert res["fake_mori"] is True
    assert [c[0] for c in res["checks"]] == [
        "READ scattered blocks byte-exact",
        "WRITE scattered blocks byte-exact",
        "notification once, after the data",
        "read from a dropped peer ends FAILED by its deadline",
    ]
    assert all(c[1] for c in res["checks"])
    assert {(r["op"], r["block_bytes"]) for r in res["throughput"]} == {
        ("READ", 4096), ("WRITE", 4096), ("READ", 65536), ("WRITE", 65536)}
    assert all(r["GB/s_median"] > 0 for r in res["throughput"])


def test_validate_script_requires_a_role():
    proc = subprocess.run([sys.executable, "bench/moriio_validate.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--role server or --role client is required" in proc.stderr
