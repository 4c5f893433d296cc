"""The changes the connector makes to the whole process it runs in, in one place.

The connector lives inside vLLM's engine processes, so a few of its settings change
behaviour that is not the connector's: vLLM's own code, or the interpreter. Each is made
here and nowhere else, so that each is

* asked for by a setting (the busy-wait yield is a product setting, on by default:
  engines pinned several to a host's cores fail without it; the thread switch interval is
  opt-in);
* applied at most once per process: asking again for what is already in place changes
  nothing and logs nothing;
* logged once at INFO, under vLLM's logger (printed in the engine's log), saying what
  changed and why;
* a WARNING naming what is missing when the thing to change is absent (a vLLM that
  renamed or moved the function its wait loops call), instead of silently nothing;
* readable back (:func:`applied_changes`), for diagnostics.

The changes:

* ``vllm_spin_yield`` — how vLLM's busy-wait loops yield (:mod:`.spin_yield`: which
  function, and why ``auto`` chooses per host). Every process that builds the connector.
* ``gil_switch_interval_s`` — ``sys.setswitchinterval``: how long the connector's threads
  may wait for the GIL held by vLLM's busy worker loop. Only when set above 0, and only in
  the worker's process (the connector's side-channel and copy threads run there).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

from .spin_yield import apply_spin_yield, missing_yield_sites

__all__ = ["ProcessChange", "tune_process", "applied_changes"]

#: under vLLM's logger, whose handler (set up by vLLM in every engine process) prints INFO
log = logging.getLogger(f"vllm.{__name__}")

_WHY_YIELD = ("vLLM's os.sched_yield() starves the connector's side-channel thread where more vLLM worker "
              "processes than CPUs share cores (docs/vllm/USAGE.md, Busy-wait yield)")

#: what each ``vllm_spin_yield`` mode makes vLLM's loops yield with
_YIELD_WITH = {
    "auto": "time.sleep(0) while more vLLM workers than CPUs share this process's CPUs, else vLLM's own "
            "os.sched_yield() (a census of the host, retaken every few seconds)",
    "sleep": "time.sleep(0)",
    "sched_yield": "vLLM's own os.sched_yield() again",
}


@dataclass(frozen=True)
class ProcessChange:
    """One process-wide change as made: the setting that asked for it and its value, what
    was changed, and what was missing (so could not be changed)."""

    setting: str
    value: str | float
    changed: tuple[str, ...]
    missing: tuple[str, ...] = ()


_lock = threading.Lock()
#: the latest change made per setting, in this process
_applied: dict[str, ProcessChange] = {}
#: what a WARNING already named as missing, per setting
_warned: set[tuple[str, str]] = set()


def tune_process(spin_yield: str, switch_interval_s: float = 0.0) -> None:
    """Apply the connector's process-wide settings: vLLM's busy-wait yield mode
    (``vllm_spin_yield``) and, when above 0, Python's thread switch interval in seconds
    (``gil_switch_interval_s``). Called from the connector's constructor; safe to call
    again (what is in place already is left alone, unlogged)."""
    with _lock:
        _tune_spin_yield(spin_yield)
        if switch_interval_s > 0:
            _tune_switch_interval(switch_interval_s)


def applied_changes() -> dict[str, ProcessChange]:
    """The process-wide changes made in this process, by setting name (the latest of each)."""
    with _lock:
        return dict(_applied)


def _warn_missing(setting: str, missing: list[str], what: str) -> None:
    for name in missing:
        if (setting, name) not in _warned:
            _warned.add((setting, name))
            log.warning("kvtransport: cannot change %s as %s asks: this vLLM has no %s (renamed or moved in "
                        "this vLLM version?); left as vLLM ships it there", what, setting, name)


def _tune_spin_yield(mode: str) -> None:
    # vLLM as shipped needs nothing rebound, so nothing can be missing for it
    missing = missing_yield_sites() if mode != "sched_yield" else []
    _warn_missing("vllm_spin_yield", missing, "the yield of vLLM's busy-wait loops")
    changed = apply_spin_yield(mode)
    if not changed:
        return
    _applied["vllm_spin_yield"] = ProcessChange("vllm_spin_yield", mode, tuple(changed), tuple(missing))
    log.info("kvtransport: process-wide change in pid %d (vllm_spin_yield: %s): vLLM's busy-wait loops in %s "
             "now yield with %s. Why: %s", os.getpid(), mode, ", ".join(changed), _YIELD_WITH[mode], _WHY_YIELD)


def _tune_switch_interval(seconds: float) -> None:
    done = _applied.get("gil_switch_interval_s")
    if done is not None and done.value == seconds:
        return  # applied once in this process already
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    _applied["gil_switch_interval_s"] = ProcessChange("gil_switch_interval_s", seconds, ("sys.setswitchinterval",))
    log.info("kvtransport: process-wide change in pid %d (gil_switch_interval_s: %g): Python's thread switch "
             "interval set from %g s to %g s. Why: vLLM's worker loop holds the GIL while it busy-waits, so the "
             "connector's side-channel and copy threads wait up to one interval for it (opt-in; 0 leaves "
             "Python's default)", os.getpid(), seconds, before, seconds)
