"""pytest plugin: run the shipped conformance suite on the moriio backend over a FAKE mori.io.

    pytest -p tests.moriio.fake_mori_plugin --pyargs kvtransport.testing.conformance \
        --kvt-backend moriio --kvt-backend-options '{"host": "127.0.0.1"}' -k inproc

Only the in-process topology can run: the fake moves bytes with memmove inside one
process. This exercises our glue under every conformance check; it proves nothing about
mori itself (that needs the hardware run, docs/MORIIO.md).
"""

from __future__ import annotations

from kvtransport_moriio.backend import using_mori_module

from .fake_mori_io import make_fake_mori_io

_seam = None


def pytest_configure(config):
    global _seam
    _seam = using_mori_module(make_fake_mori_io())
    _seam.__enter__()


def pytest_unconfigure(config):
    if _seam is not None:
        _seam.__exit__(None, None, None)
