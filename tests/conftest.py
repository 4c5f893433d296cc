"""The suite runs in the same environment whatever shell starts it.

A user who followed the README's quick start has ``KVTRANSPORT_SECRET`` exported; an
operator may have ``UCX_TLS`` or ``VLLM_*`` settings in their profile. Each of those changes
what the product does (another cluster secret, other UCX transports, another vLLM
behaviour), so a test that inherits them checks something else than it says. This
conftest is imported before any test module (and so before any module that reads these
variables at import time) and removes every variable that configures the product or the
libraries under test. Tests that need one set it themselves (``monkeypatch.setenv``, or the
environment they build for a child process).

Kept: the test runner's own contract (``KVT_REQUIRED_BACKENDS``, set by ``scripts/dev.sh``
and ``.ci/run``), the knobs that select cases or say where reports go, and opt-in locations
for hardware-only tests: none of them configures product behaviour.
"""

from __future__ import annotations

import os

#: variable-name prefixes that configure kvtransport, its backends' libraries or vLLM
SCRUBBED_PREFIXES = ("KVTRANSPORT_", "KVT_", "UCX_", "NIXL_", "MC_", "VLLM_")

#: runner settings that configure no product behaviour
KEPT = frozenset({
    "KVT_REQUIRED_BACKENDS",   # which backends must run (fail instead of skip)
    "KVT_MORIIO_HOST",         # address of an RDMA host, for the hardware-only mori tests
    "KVT_MORI_WHEEL_CACHE",    # where the mori signature test keeps downloaded wheels
    "KVT_VENV",                # which venv scripts/dev.sh used
    "KVT_E2E_KINDS",           # which model kinds tests/e2e/test_model_kinds.py runs
    "KVT_E2E_BACKENDS",        # which backends the end-to-end tests run
    "KVT_E2E_LOG_DIR",         # where end-to-end tests keep engine logs
    "KVT_SOAK_REPORT",         # where the soak test writes its report
})


def scrub_environment(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """Remove product-configuring variables from ``environ``; return their names, sorted."""
    gone = sorted(k for k in environ if k.startswith(SCRUBBED_PREFIXES) and k not in KEPT)
    for k in gone:
        del environ[k]
    return gone


SCRUBBED = scrub_environment(os.environ)
os.environ["HF_HUB_OFFLINE"] = "1"  # models are local files; never reach for a hub


def pytest_addoption(parser) -> None:
    parser.getgroup("kvtransport").addoption(
        "--link-flap", action="store_true", default=False,
        help="also run tests/e2e/test_link_flap.py (a real link cut per backend between two network "
             "namespaces, 10-15 minutes; docs/bench/HEALING.md)")


def pytest_report_header() -> str:
    return ("environment scrubbed of: " + ", ".join(SCRUBBED)) if SCRUBBED else "environment: nothing to scrub"
