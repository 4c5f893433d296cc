"""vLLM's busy-wait yield in the processes running the connector (spin_yield.py).

What a user relies on: by default vLLM's shared-memory wait loop stays as vLLM ships it
(``os.sched_yield``); with ``vllm_spin_yield: sleep`` the engine core and the workers that
build the connector make it yield with ``time.sleep(0)`` (the loop otherwise starves our
side-channel thread when more engine processes spin than there are cores, docs/VLLM.md
"Busy-wait yield"); a wrong value is a start-up error naming the setting. Checked on the installed vLLM, through
real engines (Scheduler + both connector roles).
"""

from __future__ import annotations

import importlib

import pytest

from harness import Engine, free_port_base
from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError
from kvtransport_vllm.spin_yield import apply_spin_yield, sleep_yield

shm_broadcast = importlib.import_module("vllm.distributed.device_communicators.shm_broadcast")
vllm_utils = importlib.import_module("vllm.distributed.utils")


@pytest.fixture
def vllm_as_shipped():
    """vLLM's own yield in both modules for the test (whatever earlier engines in this
    process set), and the state before the test put back afterwards."""
    saved = vllm_utils.sched_yield, shm_broadcast.sched_yield
    apply_spin_yield("sched_yield")
    original = shm_broadcast.sched_yield
    assert original is not sleep_yield and original is vllm_utils.sched_yield
    yield original
    vllm_utils.sched_yield, shm_broadcast.sched_yield = saved


def _loop_yield():
    """The function vLLM's shared-memory wait loop calls between checks (SpinCondition.wait
    looks ``sched_yield`` up in its module's globals at each call)."""
    return shm_broadcast.SpinCondition.wait.__globals__["sched_yield"]


@pytest.mark.parametrize("extra, sleeps", [({"vllm_spin_yield": "sleep"}, True), ({}, False)],
                         ids=["sleep-swaps-in-time.sleep(0)", "default-leaves-vllm-as-shipped"])
def test_engine_makes_vllm_wait_loop_yield_as_set(vllm_as_shipped, extra, sleeps):
    assert _loop_yield() is vllm_as_shipped
    engine = Engine("kv_consumer", {"side_channel_port": free_port_base(), **extra})
    try:
        want = sleep_yield if sleeps else vllm_as_shipped
        assert _loop_yield() is want
        assert vllm_utils.sched_yield is want
    finally:
        engine.close()


def test_apply_is_idempotent_and_names_what_it_changed(vllm_as_shipped):
    changed = apply_spin_yield("sleep")
    assert set(changed) == {"vllm.distributed.utils", "vllm.distributed.device_communicators.shm_broadcast"}
    assert apply_spin_yield("sleep") == []
    assert _loop_yield() is sleep_yield
    assert set(apply_spin_yield("sched_yield")) == set(changed)  # vLLM's own function put back
    assert _loop_yield() is vllm_as_shipped
    assert apply_spin_yield("sched_yield") == []


def test_sleep_yield_releases_the_gil_without_blocking():
    import threading
    import time

    ran = threading.Event()
    t = threading.Thread(target=ran.set)
    t.start()
    give_up = time.monotonic() + 5
    while not ran.is_set() and time.monotonic() < give_up:
        sleep_yield()
    t.join()
    assert ran.is_set()


@pytest.mark.parametrize("value", ["yield", "", 1, None])
def test_wrong_value_is_a_start_up_error_naming_the_setting(value):
    with pytest.raises(ConnectorConfigError, match="vllm_spin_yield must be 'sleep' or 'sched_yield'"):
        ConnectorConfig.from_extra("kv_consumer", "e", {"vllm_spin_yield": value})


def test_default_is_vllms_own():
    assert ConnectorConfig.from_extra("kv_consumer", "e", {}).vllm_spin_yield == "sched_yield"
