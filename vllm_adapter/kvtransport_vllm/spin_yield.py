"""How vLLM's busy-wait loops give the CPU away, in the processes running the connector.

vLLM's engine core and its workers wait for each other on a shared-memory ring
(``shm_broadcast``): for a second after each message the reader spins, calling
``vllm.distributed.utils.sched_yield()`` between checks. On Python >= 3.11.1 that is
``os.sched_yield()``; before, vLLM used ``time.sleep(0)``. An engine keeps stepping (so
its processes keep spinning) while a request waits for remote KV or while finished
blocks are held for a consumer: exactly the time the connector must answer its peers.

Why the connector cares. Its side-channel server is a thread inside those processes and
needs the GIL. Measured on this project's 2-core CI machine (Linux 6.18, EEVDF
scheduler; a TP=2 prefill engine and a TP=1 decode engine on the two cores): the kernel
charges a yielding thread a whole time slice per ``sched_yield()``, so a spinner that is
preempted while holding the GIL is not run again for seconds to a minute, and every other
thread of its process (our side-channel thread included) waits with it. Peers saw
replies 15-60 s late (a sealed request then refused as stale, loads ending at their
deadline; the e2e hetero-TP test failed 4 runs out of 4). With ``time.sleep(0)`` (a
system call that releases the GIL without the scheduler penalty) the same pair served
each request in 0.1-0.2 s (docs/VLLM.md, "Busy-wait yield").

The price of ``time.sleep(0)``: a spinner no longer hands its core to a ready process
of the same engine, so where an engine's processes share one core the hops between them
wait for the spinner's time slice. Measured with ``bench/e2e_latency.py`` (each engine on
one core, one run): sequential p50 92.8 ms with vLLM's ``sched_yield`` against 171.7 ms
with ``time.sleep(0)``; concurrency 8: 213 against 302 ms.

So the default (``vllm_spin_yield: sched_yield``) leaves vLLM's loops as shipped, and
``vllm_spin_yield: sleep`` switches them, in each process that builds the connector (engine
core and workers), to ``time.sleep(0)``, vLLM's own choice for older Pythons: for hosts
where more engine processes spin than there are cores (e.g. a TP=2 engine and another
engine on two cores), where a stalled side channel costs far more than the extra hop time.
"""

from __future__ import annotations

import importlib
import logging
import time

__all__ = ["SPIN_YIELD_MODES", "sleep_yield", "apply_spin_yield"]

log = logging.getLogger(__name__)

#: accepted values of the ``vllm_spin_yield`` setting
SPIN_YIELD_MODES = ("sleep", "sched_yield")

#: vLLM modules that call (and bind by name) ``sched_yield`` in their wait loops
_MODULES = ("vllm.distributed.utils", "vllm.distributed.device_communicators.shm_broadcast")

#: vLLM's own yield function per module, recorded before it is first replaced
_ORIGINAL: dict[str, object] = {}


def sleep_yield() -> None:
    """vLLM's yield before Python 3.11.1: release the GIL and return, with no scheduler penalty."""
    time.sleep(0)


def apply_spin_yield(mode: str) -> list[str]:
    """Make vLLM's wait loops in this process yield with :func:`sleep_yield` (``mode``
    ``"sleep"``) or with vLLM's own function (``"sched_yield"``: as shipped, or put back if
    an earlier call replaced it). Returns the modules changed; idempotent. A vLLM without
    these modules or names is left unchanged (nothing to do)."""
    if mode not in SPIN_YIELD_MODES:
        raise ValueError(f"vllm_spin_yield must be one of {SPIN_YIELD_MODES}, got {mode!r}")
    if mode == "sched_yield" and not _ORIGINAL:
        return []  # the default, and nothing was ever replaced: vLLM's loops are as shipped
    changed = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "sched_yield", None)
        if not callable(current):
            continue
        if current is not sleep_yield:
            _ORIGINAL.setdefault(name, current)
        wanted = sleep_yield if mode == "sleep" else _ORIGINAL.get(name, current)
        if current is not wanted:
            module.sched_yield = wanted
            changed.append(name)
    if changed and mode == "sleep":
        log.info("kvtransport: vLLM's busy-wait loops in this process yield with time.sleep(0) "
                 "(vllm_spin_yield: sleep; docs/VLLM.md, Busy-wait yield)")
    return changed

