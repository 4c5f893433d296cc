"""Process-wide changes the connector makes, all through process_tuning.py.

What an operator relies on: the connector changes its engine process only as its settings
say — vLLM's busy-wait yield (``vllm_spin_yield``, on by default) and, opt-in only, Python's
thread switch interval (``gil_switch_interval_s``, default 0: Python's own); each change is
made once and logged once at INFO with what and why; a vLLM lacking the function to change
gets a WARNING naming it instead of a silent no-op; what was applied can be read back.
Checked on the installed vLLM and through real engines (Scheduler + both connector roles).
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest

from harness import Engine, free_port_base
from kvtransport_vllm.config import ConnectorConfig
from kvtransport_vllm.process_tuning import applied_changes, tune_process
from kvtransport_vllm.spin_yield import YIELD_SITES, apply_spin_yield, missing_yield_sites, sleep_yield

LOGGER = "vllm.kvtransport_vllm.process_tuning"
shm_broadcast = importlib.import_module("vllm.distributed.device_communicators.shm_broadcast")
vllm_utils = importlib.import_module("vllm.distributed.utils")


@pytest.fixture
def vllm_as_shipped():
    """vLLM's own yield in both modules for the test, and the state before put back after."""
    saved = vllm_utils.sched_yield, shm_broadcast.sched_yield
    apply_spin_yield("sched_yield")
    yield
    vllm_utils.sched_yield, shm_broadcast.sched_yield = saved


@pytest.fixture
def switch_interval():
    """Python's switch interval before the test, put back after."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def _lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_spin_yield_is_applied_and_logged_once_with_what_and_why(vllm_as_shipped, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tune_process("sleep")
        tune_process("sleep")  # a second connector in this process: nothing left to change
    assert vllm_utils.sched_yield is sleep_yield and shm_broadcast.sched_yield is sleep_yield
    lines = _lines(caplog, logging.INFO)
    assert len(lines) == 1, lines
    assert "vllm_spin_yield: sleep" in lines[0] and "time.sleep(0)" in lines[0]
    assert all(site in lines[0] for site in YIELD_SITES) and "Why:" in lines[0]
    change = applied_changes()["vllm_spin_yield"]
    assert change.value == "sleep" and set(change.changed) == set(YIELD_SITES) and change.missing == ()


def test_vllm_as_shipped_is_no_change_and_logs_nothing(vllm_as_shipped, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tune_process("sched_yield")
    assert _lines(caplog, logging.INFO) == [] and _lines(caplog, logging.WARNING) == []


def test_a_vllm_without_the_function_to_rebind_gets_a_warning_naming_it(vllm_as_shipped, monkeypatch, caplog):
    """A vLLM that renamed ``sched_yield`` in one of its wait-loop modules: the other module
    is still changed, and the missing one is named once, at WARNING."""
    monkeypatch.delattr(vllm_utils, "sched_yield")
    assert missing_yield_sites() == ["vllm.distributed.utils.sched_yield"]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tune_process("sleep")
        apply_spin_yield("sched_yield")
        tune_process("sleep")
    warnings = _lines(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "vllm.distributed.utils.sched_yield" in warnings[0] and "vllm_spin_yield" in warnings[0]
    assert shm_broadcast.sched_yield is sleep_yield
    assert applied_changes()["vllm_spin_yield"].missing == ("vllm.distributed.utils.sched_yield",)


def test_switch_interval_is_opt_in_applied_once_and_logged(switch_interval, vllm_as_shipped, caplog):
    assert ConnectorConfig.from_extra("kv_consumer", "e", {}).gil_switch_interval_s == 0
    tune_process("sched_yield", 0.0)
    assert sys.getswitchinterval() == switch_interval  # 0: Python's default left alone
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tune_process("sched_yield", 0.0017)
        tune_process("sched_yield", 0.0017)
    assert sys.getswitchinterval() == pytest.approx(0.0017)
    lines = _lines(caplog, logging.INFO)
    assert len(lines) == 1 and "gil_switch_interval_s: 0.0017" in lines[0], lines
    assert applied_changes()["gil_switch_interval_s"].value == 0.0017


def test_engine_sets_the_switch_interval_in_the_worker_only_when_asked(switch_interval, vllm_as_shipped):
    sys.setswitchinterval(0.005)
    engine = Engine("kv_consumer", {"side_channel_port": free_port_base(), "vllm_spin_yield": "sched_yield"})
    engine.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)  # default: Python's interval untouched
    engine = Engine("kv_consumer", {"side_channel_port": free_port_base(), "vllm_spin_yield": "sched_yield",
                                    "gil_switch_interval_s": 0.0013})
    engine.close()
    assert sys.getswitchinterval() == pytest.approx(0.0013)
