"""What the connector measures per load and per transfer, for ``get_kv_connector_stats``.

Why a module of its own: the consumer and producer only *mark* moments (a load was
handed to the worker, hand-shook, moved its bytes, was confirmed) and name the *cause* of
an outcome; turning marks into phase durations and counters, and the one schema of the
statistics dictionary that travels worker -> scheduler -> API server (where
:mod:`.prom_metrics` exports it), live here.

A remote load's phases (seconds; their sum is ``total``, the time the request waited for
its remote KV once vLLM had allocated its blocks)::

    queued     scheduler allocated the blocks -> the worker took the load (one step's metadata)
    handshake  the worker took it -> transfer posted (hand-shake with the producer if new)
    transfer   READ: posted -> bytes in place; WRITE: write requested -> producer's "written"
    confirm    READ: bytes in place -> producer confirmed its lease held (stale-read guard)
    step       the load settled -> the end of the engine step it settled in (READ: the
               confirmation taken; WRITE: "written" arrived): vLLM hears of a load only
               when a step ends, so a load that settles during a forward waits for that
               forward whatever the connector does, as a new request would
    report     that step's end -> handed to vLLM in ``get_finished`` (done_recving): 0
               unless the connector let a step end without reporting a settled load

"The connector's own time" is ``total - transfer - step``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Cause", "HOLD_CAUSES", "LoadClock", "PHASES", "count_outcome", "new_stats", "stats_empty", "record_load",
           "record_transfer", "record_written"]

PHASES = ("queued", "handshake", "transfer", "confirm", "step", "report", "total")


class Cause(str, enum.Enum):
    """Why a load or hold ended the way it did (the ``cause`` label of the outcome counter)."""

    OK = "ok"
    TRANSPORT = "transport_failure"  # the backend refused or failed the transfer
    TIMEOUT = "timeout"  # the load's deadline passed
    LEASE_EXPIRED = "lease_expired"  # the producer's lease lapsed (its blocks were freed)
    STALE_READ = "stale_read_refused"  # bytes read from a producer that has restarted since
    PEER_GONE = "peer_gone"  # the other engine exited or is unreachable
    PEER_ABORTED = "peer_aborted"  # the other engine aborted the request
    ABORTED = "aborted"  # vLLM aborted the request here
    HANDSHAKE_REFUSED = "handshake_refused"  # incompatible or unreachable peer at hand-shake
    PARAMS_REFUSED = "params_refused"  # kv_transfer_params that cannot be loaded from
    AUTH_REFUSED = "auth_refused"  # side-channel message failed authentication
    MALFORMED = "malformed"  # side-channel message could not be decoded
    RELEASED = "released"  # producer: the consumer let the blocks go without taking them


#: Producer: why a hold ended (Producer.end_hold) -> the outcome's cause.
HOLD_CAUSES = {"done": Cause.OK, "expired": Cause.LEASE_EXPIRED, "released": Cause.RELEASED,
               "aborted": Cause.ABORTED}


@dataclass
class LoadClock:
    """Moments of one load: ``created`` is wall-clock (set by the scheduler process), the
    others are the worker's ``time.monotonic()``."""

    created: float  # time.time() when the scheduler allocated the blocks (0: unknown)
    added: float
    write: bool = False  # WRITE load: settled when "written" arrived (``transferred``)
    added_wall: float = field(default_factory=time.time)
    posted: float = 0.0
    transferred: float = 0.0
    finished: float = 0.0

    def phases(self, reported: float, step_ends: Sequence[float] = ()) -> dict[str, float]:
        """Phase durations of a load that ended (reported = monotonic time handed to vLLM;
        ``step_ends``: the times recent ``get_finished`` calls handed their loads over,
        ascending, ``reported`` among them)."""
        posted = self.posted or self.finished
        transferred = self.transferred or self.finished
        settled = min(transferred, self.finished) if self.write else self.finished
        step_end = min(next((t for t in step_ends if t >= settled), reported), reported)
        queued = max(0.0, self.added_wall - self.created) if self.created else 0.0
        out = {
            "queued": queued,
            "handshake": max(0.0, posted - self.added),
            "transfer": max(0.0, transferred - posted),
            "confirm": max(0.0, settled - transferred),
            "step": max(0.0, step_end - settled),
            "report": max(0.0, reported - step_end),
        }
        out["total"] = queued + max(0.0, reported - self.added)
        return out


def new_stats() -> dict[str, Any]:
    """Counters and observations since the last ``take_stats`` (see :mod:`.stats`)."""
    return {"bytes": 0, "transfers": 0, "failures": 0, "loads_ok": 0, "leases_expired": 0,
            "latency_s_sum": 0.0, "latency_s_max": 0.0,
            # per transfer (READ by the consumer, WRITE by the producer)
            "transfer_s": [], "transfer_bytes": [], "transfer_blocks": [],
            # per WRITE that ended: seconds from the prefill's end (hold began) to its last byte
            "write_after_prefill_s": [],
            # per ended load: phase -> durations; outcomes: "side:cause" -> count
            "phase_s": {p: [] for p in PHASES}, "outcomes": {},
            # snapshots taken at take_stats (None: unchanged since the last report)
            "holds_in_flight": None, "loads_in_flight": None}


def stats_empty(stats: dict[str, Any]) -> bool:
    """Nothing recorded in ``stats`` (a :func:`new_stats` dictionary) since it was made; the
    in-flight gauges are not records (:meth:`.stats.KVTransportStats.is_empty` adds them)."""
    return (not any(v for k, v in stats.items() if k not in ("phase_s", "holds_in_flight", "loads_in_flight"))
            and not any(stats["phase_s"].values()))


def count_outcome(stats: dict[str, Any], side: str, cause: Cause) -> None:
    key = f"{side}:{cause.value}"
    stats["outcomes"][key] = stats["outcomes"].get(key, 0) + 1


def record_transfer(stats: dict[str, Any], seconds: float, nbytes: int, nblocks: int) -> None:
    stats["transfer_s"].append(seconds)
    stats["transfer_bytes"].append(nbytes)
    stats["transfer_blocks"].append(nblocks)


def record_written(stats: dict[str, Any], held_at: float) -> None:
    """A WRITE has ended with every byte in the consumer's blocks: record how long after
    the prefill's end (the hold's start) that was. It is the part of the push the prefill's
    compute did not hide, which layer-wise WRITE shortens; in the two-hop flow it also holds
    the wait for the decode engine's block ids."""
    stats["write_after_prefill_s"].append(max(0.0, time.monotonic() - held_at))


def record_load(stats: dict[str, Any], clock: LoadClock, reported: float, cause: Cause,
                step_ends: Sequence[float] = ()) -> None:
    """A load handed to vLLM: its outcome, and its phases when it succeeded."""
    count_outcome(stats, "load", cause)
    if cause is not Cause.OK:
        return
    for phase, seconds in clock.phases(reported, step_ends).items():
        stats["phase_s"][phase].append(seconds)
