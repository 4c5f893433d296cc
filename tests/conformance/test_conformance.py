"""Runs the shipped conformance suite (kvtransport.testing.conformance) for every
installed backend; see that module. Third-party authors run the same suite with
``pytest --pyargs kvtransport.testing.conformance --kvt-backend NAME``."""

from kvtransport.testing.conformance import *  # noqa: F401,F403
