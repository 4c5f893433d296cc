"""The shipped conformance suite (in-process topology) on moriio over a FAKE mori.io.

Runs ``kvtransport.testing.conformance`` in a child pytest with the fake installed by
``fake_mori_plugin``: every conformance check then exercises our glue. Only in-process,
since the fake moves bytes with memmove inside one process. Not a proof for mori.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_conformance_suite_inproc_passes_on_fake_mori():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.moriio.fake_mori_plugin", "--pyargs",
         "kvtransport.testing.conformance", "--kvt-backend", "moriio",
         "--kvt-backend-options", '{"host": "127.0.0.1"}', "-k", "inproc", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) >= 10, tail
    assert "failed" not in proc.stdout.splitlines()[-1] and "skipped" not in proc.stdout.splitlines()[-1], tail
