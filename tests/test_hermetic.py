"""The suite gives the same result from any shell (tests/conftest.py scrubs the caller's
product settings): a test of the authenticated side channel, run in a child pytest whose
caller exported the README quick start's ``KVTRANSPORT_SECRET`` and an operator's
``UCX_TLS`` / ``VLLM_*`` settings, passes as it does from a clean shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: what a user who followed the README (and tuned UCX / vLLM) has in their shell
CALLER_EXPORTS = {
    "KVTRANSPORT_SECRET": "0123456789abcdef0123456789abcdef",  # the quick start's export
    "KVTRANSPORT_AUTH": "off",
    "UCX_TLS": "self",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
}


@pytest.mark.timeout(300)
def test_suite_ignores_the_callers_product_settings() -> None:
    env = dict(os.environ, **CALLER_EXPORTS)
    case = "tests/vllm/test_auth_connector.py::test_control_authentic_peer_does_get_the_descriptor"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", case],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
    header = next((line for line in run.stdout.splitlines() if line.startswith("environment scrubbed of: ")), "")
    scrubbed = set(header.removeprefix("environment scrubbed of: ").split(", "))
    assert set(CALLER_EXPORTS) <= scrubbed, run.stdout[:2000]
