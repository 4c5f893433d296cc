"""How vLLM's busy-wait loops give the CPU away, in the processes running the connector.

vLLM's engine core and its workers wait for each other on a shared-memory ring
(``shm_broadcast``): for a second after each message the reader spins, calling
``vllm.distributed.utils.sched_yield()`` between checks. On Python >= 3.11.1 that is
``os.sched_yield()``; before, vLLM used ``time.sleep(0)``. An engine keeps stepping (so
its processes keep spinning) while a request waits for remote KV or while finished
blocks are held for a consumer: exactly the time the connector must answer its peers.

Why the connector cares. Its side-channel server is a thread inside those processes and
needs the GIL. Measured on this project's 2-core CI machine (Linux 6.18, EEVDF
scheduler), with more vLLM worker processes pinned to a core than it has room for (a
TP=2 prefill engine and a TP=1 decode engine on two cores; or two prefill and two decode
engines, one core per two engines): a spinner preempted while it holds the GIL was not
run again for seconds to a minute, and every other thread of its process (our
side-channel thread included) waited with it. Peers saw replies 15-60 s late (a sealed
request then refused as stale, loads ending at their deadline, producer leases lapsing)
and, where one TP worker of an engine stalled past vLLM's
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s: the engine core's wait for a step's
result), the engine died. With ``time.sleep(0)`` (a system call that releases the GIL
without the scheduler's yield accounting) the same engines served each request in
0.1-0.2 s (docs/vllm/USAGE.md, "Busy-wait yield").

The price of ``time.sleep(0)``: a spinner no longer hands its core to a ready process
of the same engine, so where an engine's processes share one core the hops between them
wait for the spinner's time slice. Measured with ``bench/e2e_latency.py`` (each engine on
one core, one run): sequential p50 92.8 ms with vLLM's ``sched_yield`` against 171.7 ms
with ``time.sleep(0)``; concurrency 8: 213 against 302 ms.

So neither is right everywhere, and the default, ``vllm_spin_yield: auto``, decides from
where the workers run: :func:`host_census` counts the vLLM worker processes on this host
(process title ``VLLM::Worker...``) whose CPU affinity overlaps this process's, and the
CPUs all of them may run on. More workers than CPUs: ``time.sleep(0)``; otherwise vLLM's
own ``sched_yield``. The engine core and API server are not counted: they wait for their
workers, and one engine per core (each with its engine core) is the layout where
``sched_yield`` is both safe and faster. Workers start after the connector of the engine
core is built, and other engines may start later, so the census is taken again at most
every :data:`RECHECK_S` seconds, from inside the wait loop (an idle moment by definition),
and the choice is logged once, and again whenever it changes. ``sleep`` and
``sched_yield`` fix the choice for a process.

Rebinding vLLM's function changes the whole process, not just the connector: the connector
does it only through :mod:`.process_tuning`, which logs the change once and warns when the
function to rebind is missing (:func:`missing_yield_sites`).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

__all__ = ["SPIN_YIELD_MODES", "RECHECK_S", "HostCensus", "host_census", "census_of", "sleep_yield",
           "AutoYield", "apply_spin_yield", "missing_yield_sites", "YIELD_SITES"]

#: under vLLM's logger, whose handler (set up by vLLM in every engine process) prints INFO: the
#: choice changes how vLLM's loops behave, so it must show in the engine's own log
log = logging.getLogger(f"vllm.{__name__}")

#: accepted values of the ``vllm_spin_yield`` setting (the first is the default)
SPIN_YIELD_MODES = ("auto", "sleep", "sched_yield")

#: vLLM modules that call (and bind by name) ``sched_yield`` in their wait loops
YIELD_SITES = ("vllm.distributed.utils", "vllm.distributed.device_communicators.shm_broadcast")

#: the process title vLLM gives its worker processes (``VLLM::Worker_TP0``, ``VLLM::Worker_PP1_TP0``, ...);
#: the kernel keeps its first 15 bytes as the process name, which this prefix fits in
WORKER_TITLE = b"VLLM::Worker"

#: longest an automatic choice is kept before the census is taken again (seconds)
RECHECK_S = 5.0

#: vLLM's own yield function per module, recorded before it is first replaced
_ORIGINAL: dict[str, object] = {}


@dataclass(frozen=True)
class HostCensus:
    """The vLLM workers that compete for this process's CPUs, and the CPUs they may use."""

    workers: int
    cpus: int

    @property
    def oversubscribed(self) -> bool:
        """More spinning workers than CPUs to run them on: ``sched_yield`` is unsafe."""
        return self.workers > self.cpus


def census_of(own_cpus: set[int], worker_cpus: list[set[int]]) -> HostCensus:
    """The rule, on given facts: the workers whose CPU set overlaps ``own_cpus``, and the
    union of their sets with ``own_cpus``."""
    sharing = [c for c in worker_cpus if c & own_cpus]
    union = set(own_cpus).union(*sharing) if sharing else set(own_cpus)
    return HostCensus(len(sharing), len(union))


def host_census(proc: str = "/proc") -> HostCensus:
    """:func:`census_of` for this host now: this thread's CPU affinity, and each process
    whose name starts with vLLM's worker title with its affinity. Stopped processes
    (SIGSTOP: they compete for nothing) and zombies are not counted; a process that ends
    while it is read is skipped.

    Only ``/proc/<pid>/stat`` is read (the name vLLM's ``setproctitle`` also gives the
    process, and its state), never ``/proc/<pid>/cmdline``: reading a command line takes
    that process's memory-map lock, so one process stuck in the kernel with it held would
    block the census, and the census runs inside vLLM's wait loop: a worker blocked there
    past ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` kills its engine."""
    own = os.sched_getaffinity(0)
    sets = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                head, _, rest = f.read().rpartition(b")")  # "pid (comm" and " state ..."
            if not head.partition(b"(")[2].startswith(WORKER_TITLE):
                continue
            if rest.split()[0] in (b"T", b"t", b"Z", b"X"):
                continue
            sets.append(os.sched_getaffinity(int(name)))
        except (OSError, IndexError):  # gone, or not ours to read
            continue
    return census_of(own, sets)


def sleep_yield() -> None:
    """vLLM's yield before Python 3.11.1: release the GIL and return, with no scheduler penalty."""
    time.sleep(0)


class AutoYield:
    """The ``auto`` yield: ``time.sleep(0)`` while :func:`host_census` finds more workers
    than CPUs, else the wrapped (vLLM's own) function; the census is retaken at most every
    :data:`RECHECK_S` seconds, at a call (so only while a loop spins). Two threads calling
    at once may both take the census: harmless (the same answer, at worst logged twice)."""

    def __init__(self, shipped: Callable[[], None], census: Callable[[], HostCensus] = host_census,
                 recheck_s: float = RECHECK_S) -> None:
        self.shipped = shipped
        self._census = census
        self._recheck_s = recheck_s
        self._next_check = 0.0
        self._sleep = False
        self._logged: bool | None = None

    def __call__(self) -> None:
        now = time.monotonic()
        if now >= self._next_check:
            self._decide(now)
        if self._sleep:
            time.sleep(0)
        else:
            self.shipped()

    def _decide(self, now: float) -> None:
        try:
            census = self._census()
        except (OSError, AttributeError) as exc:  # no /proc or no sched_getaffinity: keep vLLM's own choice
            log.debug("kvtransport: CPU census failed (%s); vLLM's busy-wait loops keep sched_yield", exc)
            census = HostCensus(0, 1)
        self._sleep = census.oversubscribed
        self._next_check = now + self._recheck_s
        if self._logged != self._sleep:
            self._logged = self._sleep
            how = "time.sleep(0)" if self._sleep else "vLLM's os.sched_yield()"
            log.info("kvtransport: vLLM's busy-wait loops in this process (pid %d) yield with %s: %d vLLM worker "
                     "process(es) on this host share %d CPU(s) with it (vllm_spin_yield: auto; set sleep or "
                     "sched_yield to fix the choice; docs/vllm/USAGE.md, Busy-wait yield)", os.getpid(), how,
                     census.workers, census.cpus)


#: the one automatic yield of this process (one census, one log line for both modules)
_AUTO: AutoYield | None = None


def _wanted(mode: str, original: object) -> object:
    global _AUTO
    if mode == "sleep":
        return sleep_yield
    if mode == "sched_yield":
        return original
    if _AUTO is None:
        _AUTO = AutoYield(original)
    return _AUTO


def _yield_site(name: str) -> tuple[ModuleType | None, str | None]:
    """The module ``name`` if it has a callable ``sched_yield`` to rebind, else what is missing."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return None, f"module {name} ({exc})"
    if not callable(getattr(module, "sched_yield", None)):
        return None, f"{name}.sched_yield"
    return module, None


def missing_yield_sites() -> list[str]:
    """What of :data:`YIELD_SITES` the installed vLLM lacks (a module, or its
    ``sched_yield``), each named: there :func:`apply_spin_yield` can change nothing."""
    return [missing for missing in (_yield_site(name)[1] for name in YIELD_SITES) if missing]


def apply_spin_yield(mode: str) -> list[str]:
    """Make vLLM's wait loops in this process yield with :func:`sleep_yield` (``"sleep"``),
    with vLLM's own function (``"sched_yield"``: as shipped, or put back if an earlier call
    replaced it) or with this process's :class:`AutoYield` (``"auto"``). Returns the modules
    changed; idempotent. A vLLM without these modules or names is left unchanged
    (:func:`missing_yield_sites` names them). Logs nothing: the caller,
    :func:`.process_tuning.tune_process`, logs what changed."""
    if mode not in SPIN_YIELD_MODES:
        raise ValueError(f"vllm_spin_yield must be one of {SPIN_YIELD_MODES}, got {mode!r}")
    if mode == "sched_yield" and not _ORIGINAL:
        return []  # nothing was ever replaced: vLLM's loops are as shipped
    changed = []
    for name in YIELD_SITES:
        module, _ = _yield_site(name)
        if module is None:
            continue
        current = module.sched_yield
        if current is not sleep_yield and not isinstance(current, AutoYield):
            _ORIGINAL.setdefault(name, current)
        wanted = _wanted(mode, _ORIGINAL.get(name, current))
        if current is not wanted:
            module.sched_yield = wanted
            changed.append(name)
    return changed
