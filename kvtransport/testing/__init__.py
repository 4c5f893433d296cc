"""Test helpers shipped with kvtransport, so third-party backends can run the
conformance suite: ``pytest --pyargs kvtransport.testing.conformance --kvt-backend NAME``."""
