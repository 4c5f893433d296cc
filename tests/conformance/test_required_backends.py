"""The required-backends setting (``KVT_REQUIRED_BACKENDS``, set by ``.ci/run`` and
``scripts/dev.sh test``): a backend that cannot run here is *skipped with its reason*
by default, and FAILS the run, naming the reason, when it is required.

Each case runs the shipped conformance suite in a child pytest, exactly as CI does,
against a backend installed for this test only (a ``*.dist-info`` with one entry point
on ``PYTHONPATH``) that can never run: one whose probe says no, one whose module fails
to import, and a name that is not installed at all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: What the unusable backends say; the child's output must carry it.
PROBE_REASON = "no frobnicator device on this host"
PROBE_HINT = "plug in a frobnicator"
IMPORT_REASON = "frobnicator driver library is missing"

UNUSABLE_MODULE = f'''
from kvtransport.spi import Availability, Backend


class NeverUsable(Backend):
    @classmethod
    def probe(cls):
        return Availability(False, {PROBE_REASON!r}, {PROBE_HINT!r})
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding two 'installed' test backends: importable, never usable."""
    d = tmp_path_factory.mktemp("required_site")
    (d / "kvt_never_usable.py").write_text(UNUSABLE_MODULE)
    (d / "kvt_broken_import.py").write_text(f"raise ImportError({IMPORT_REASON!r})\n")
    info = d / "kvt_required_test-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvt-required-test\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[kvtransport.backends]\n"
        "never-usable = kvt_never_usable:NeverUsable\n"
        "broken-import = kvt_broken_import:Broken\n")
    return d


def _run(site: Path, backend: str, required: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env.pop("KVT_REQUIRED_BACKENDS", None)
    if required is not None:
        env["KVT_REQUIRED_BACKENDS"] = required
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvtransport.testing.conformance",
           "--kvt-backend", backend, "-k", "test_standalone_notification",
           "-p", "no:cacheprovider", "-q", "-rA"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=site)


def _counts(stdout: str) -> dict[str, int]:
    """pytest's final summary line ("1 failed, 16 deselected in 1.2s") as counts."""
    last = stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last)}


@pytest.mark.parametrize("backend, reason", [
    ("never-usable", PROBE_REASON),
    ("broken-import", IMPORT_REASON),
    ("not-installed-anywhere", "installed backends"),
])
def test_unusable_backend_skips_by_default_and_fails_when_required(site, backend, reason):
    skipped = _run(site, backend, required=None)
    assert skipped.returncode == 0, skipped.stdout[-3000:] + skipped.stderr[-2000:]
    counts = _counts(skipped.stdout)
    assert counts.get("skipped", 0) >= 1 and "passed" not in counts and "failed" not in counts, counts
    assert reason in skipped.stdout

    failed = _run(site, backend, required=f"loopback,{backend}")
    out = failed.stdout + failed.stderr
    assert failed.returncode == 1, out[-3000:]  # 1: tests failed (not a usage or internal error)
    counts = _counts(failed.stdout)
    assert "skipped" not in counts and "passed" not in counts, counts
    assert counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0) >= 1, counts
    assert reason in out and "KVT_REQUIRED_BACKENDS" in out
    if backend == "never-usable":
        assert PROBE_HINT in out  # the fix is named too


def test_required_setting_does_not_touch_usable_backends(site):
    """loopback is usable: with it required, its case runs and passes as before."""
    ok = _run(site, "loopback", required="loopback")
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert _counts(ok.stdout) == {"passed": 2, "deselected": _counts(ok.stdout).get("deselected", 0)}
