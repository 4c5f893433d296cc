"""Test helpers shipped with kvtransport, so third-party backends can run the
conformance suite: ``pytest --pyargs kvtransport.testing.conformance --kvt-backend NAME``.

A backend that cannot run here is skipped with its reason, unless it is named in
``KVT_REQUIRED_BACKENDS`` (:mod:`kvtransport.testing.required`): then its tests fail."""
