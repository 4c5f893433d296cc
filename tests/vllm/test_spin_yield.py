"""vLLM's busy-wait yield in the processes running the connector (spin_yield.py).

What a user relies on: by default (``vllm_spin_yield: auto``) vLLM's shared-memory wait loop
yields with ``time.sleep(0)`` while more vLLM worker processes share this process's CPUs
than there are CPUs (the loop's ``os.sched_yield`` otherwise starves our side-channel thread,
docs/vllm/USAGE.md "Busy-wait yield"), else with vLLM's own ``os.sched_yield``; ``sleep`` and
``sched_yield`` fix the choice; a wrong value is a start-up error naming the setting.
Checked on the installed vLLM, through real engines (Scheduler + both connector roles), and
the census on this host's real processes.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys

import pytest

from harness import Engine, free_port_base
from kvtransport_vllm.config import ConnectorConfig, ConnectorConfigError
from kvtransport_vllm.spin_yield import (AutoYield, HostCensus, apply_spin_yield, census_of, host_census,
                                         sleep_yield)

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


@pytest.mark.parametrize("extra, kind", [({"vllm_spin_yield": "sleep"}, "sleep"),
                                         ({"vllm_spin_yield": "sched_yield"}, "shipped"), ({}, "auto")],
                         ids=["sleep-swaps-in-time.sleep(0)", "sched_yield-leaves-vllm-as-shipped",
                              "default-auto-wraps-vllms-own"])
def test_engine_makes_vllm_wait_loop_yield_as_set(vllm_as_shipped, extra, kind):
    assert _loop_yield() is vllm_as_shipped
    engine = Engine("kv_consumer", {"side_channel_port": free_port_base(), **extra})
    try:
        got = _loop_yield()
        assert vllm_utils.sched_yield is got
        if kind == "auto":
            assert isinstance(got, AutoYield) and got.shipped is vllm_as_shipped
            got()  # the loop's call: takes the census, then yields one way or the other
        else:
            assert got is (sleep_yield if kind == "sleep" else vllm_as_shipped)
    finally:
        engine.close()


def test_apply_is_idempotent_and_names_what_it_changed(vllm_as_shipped):
    changed = apply_spin_yield("sleep")
    assert set(changed) == {"vllm.distributed.utils", "vllm.distributed.device_communicators.shm_broadcast"}
    assert apply_spin_yield("sleep") == []
    assert _loop_yield() is sleep_yield
    assert set(apply_spin_yield("auto")) == set(changed)
    auto = _loop_yield()
    assert isinstance(auto, AutoYield) and auto.shipped is vllm_as_shipped  # wraps vLLM's own, not ours
    assert apply_spin_yield("auto") == [] and vllm_utils.sched_yield is auto  # one per process
    assert set(apply_spin_yield("sched_yield")) == set(changed)  # vLLM's own function put back
    assert _loop_yield() is vllm_as_shipped
    assert apply_spin_yield("sched_yield") == []


#: CPU sets of the vLLM workers of deployments on a 2-core host (one set per worker process)
LAYOUTS = {
    "1P1D, one core per engine": [{0}, {1}],
    "2P2D, two engines per core": [{0}, {1}, {0}, {1}],
    "1P2D": [{0}, {1}, {1}],
    "prefill TP 2 + decode TP 1": [{0}, {1}, {1}],
    "one TP 2 engine": [{0}, {1}],
}


@pytest.mark.parametrize("layout, oversubscribed", [
    ("1P1D, one core per engine", False), ("2P2D, two engines per core", True), ("1P2D", True),
    ("prefill TP 2 + decode TP 1", True), ("one TP 2 engine", False)])
def test_census_rule_on_deployment_layouts(layout, oversubscribed):
    workers = LAYOUTS[layout]
    # the view of every process: the unpinned engine core ({0, 1}) and each pinned worker
    views = [census_of({0, 1}, workers)] + [census_of(own, workers) for own in workers]
    assert views[0].oversubscribed is oversubscribed  # the engine core sees every worker
    if not oversubscribed:
        assert not any(v.oversubscribed for v in views)
    else:  # a worker on a core with two workers sees it; one alone on its core need not
        crowded = {c for c in (0, 1) if sum(c in w for w in workers) > 1}
        for own, view in zip(workers, views[1:]):
            assert view.oversubscribed is bool(own & crowded), (own, view)


def _fake_worker(cpu: int) -> subprocess.Popen:
    """A process titled as vLLM titles its workers (``setproctitle``, which also sets the
    process name the census reads), pinned to ``cpu``; it waits on stdin and ends when
    stdin closes. Returns once the child has written a byte after taking its title."""
    p = subprocess.Popen([sys.executable, "-c",
                          "import sys, setproctitle; setproctitle.setproctitle('VLLM::Worker_TP0'); "
                          "sys.stdout.write('r'); sys.stdout.flush(); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.read(1) == b"r"  # titled
    os.sched_setaffinity(p.pid, {cpu})
    return p


def test_host_census_counts_this_hosts_vllm_workers_on_our_cpus():
    cpu = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    procs = [_fake_worker(cpu) for _ in range(3)]
    try:
        os.sched_setaffinity(0, {cpu})  # this thread: pinned like a worker on that core
        census = host_census()
        os.sched_setaffinity(0, saved)
        # three workers on one core (more may run on this host: other engines can only add)
        assert census.workers >= 3 and census.oversubscribed, census
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)  # stopped (e.g. a benchmark freezing idle engines): competes for nothing
            os.waitpid(p.pid, os.WUNTRACED)  # returns once the kernel has stopped it
        try:
            os.sched_setaffinity(0, {cpu})
            frozen = host_census()
            os.sched_setaffinity(0, saved)
        finally:
            for p in procs:
                os.kill(p.pid, signal.SIGCONT)
        # (other engines on this host may start or stop meanwhile: the three frozen ones must not count)
        assert frozen.workers < census.workers, (census, frozen)
    finally:
        os.sched_setaffinity(0, saved)
        for p in procs:
            p.stdin.close()
            p.wait(timeout=10)
            p.stdout.close()


def test_auto_yield_follows_the_census_and_logs_each_choice_once(caplog):
    calls, censuses = [], iter([HostCensus(1, 1)] * 2 + [HostCensus(3, 2)] * 2 + [HostCensus(2, 2)])
    auto = AutoYield(lambda: calls.append("shipped"), census=lambda: next(censuses), recheck_s=0)
    with caplog.at_level(logging.INFO, logger="vllm.kvtransport_vllm.spin_yield"):
        for _ in range(5):
            auto()
    # vLLM's own yield while workers <= CPUs; time.sleep(0) (not vLLM's) while oversubscribed
    assert calls == ["shipped"] * 3
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.kvtransport_vllm.spin_yield"]
    assert len(lines) == 3, lines  # once per choice: sched_yield, sleep, sched_yield again
    assert "os.sched_yield()" in lines[0] and "time.sleep(0)" in lines[1] and "os.sched_yield()" in lines[2]
    assert "3 vLLM worker process(es) on this host share 2 CPU(s)" in lines[1]


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
    with pytest.raises(ConnectorConfigError, match="vllm_spin_yield must be 'auto', 'sleep' or 'sched_yield'"):
        ConnectorConfig.from_extra("kv_consumer", "e", {"vllm_spin_yield": value})


def test_default_is_auto():
    assert ConnectorConfig.from_extra("kv_consumer", "e", {}).vllm_spin_yield == "auto"
