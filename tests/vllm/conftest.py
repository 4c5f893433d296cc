from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Side-channel secret of every engine built by these tests: see harness.TEST_SECRET.
os.environ.setdefault("KVTRANSPORT_SECRET", "kvtransport-test-cluster-secret")
sys.path.insert(0, os.path.dirname(__file__))

if TYPE_CHECKING:
    from harness import Pair


@pytest.fixture
def pairs() -> Iterator[Callable[..., Pair]]:
    """Make producer/consumer pairs, ``pairs(*args, **kwargs)`` -> ``harness.Pair``, with
    the settings each test needs; every pair made is closed when the test ends, pass or
    fail, so its side-channel ports and agents never outlive the test."""
    # Imported here, not at the top: files that build no engine need not load vLLM.
    from harness import Pair

    made: list[Pair] = []

    def make(*args, **kwargs) -> Pair:
        p = Pair(*args, **kwargs)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
