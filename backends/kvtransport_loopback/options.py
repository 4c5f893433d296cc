"""Backend options of ``kvt.open("loopback", **options)``, declared with the core's schema."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtransport.options_schema import Option, OptionsSchema, integer, one_of, text
from kvtransport.spi import usable_cpus

from .ptrace import GRANT_MODES

SCHEMA = OptionsSchema(
    "loopback",
    # Default: two copy threads, or one when this thread may run on one CPU only.
    Option("threads", check=integer(1), default_factory=lambda: min(2, usable_cpus())),
    # Where the notification socket goes; None: a private directory of our own.
    Option("notify_dir", None, text(what="a directory path", optional=True)),
    # Below this size a transfer is copied by one thread: splitting costs more than it saves.
    Option("min_split_bytes", 8 << 20, integer(0)),
    Option("ptrace_grant", "peer", one_of(*GRANT_MODES)),
    # Up to this size a transfer without notification is copied on the posting thread:
    # a KV load of a few blocks takes tens of microseconds, far less than handing it to a
    # copy thread, which must then win the GIL back (from a busy engine loop) to report.
    Option("inline_bytes", 1 << 20, integer(0)),
    # The CPUs the copy threads run on (a list, or a Linux cpulist string such as "2,4-5");
    # None: those of the thread that opens the agent, which they inherit.
    Option("copy_cpus", None, lambda v: cpu_list(v)),
)


def cpu_list(v: Any) -> tuple[int, ...] | None:
    """None, a non-empty list of CPU numbers, or a cpulist string ("2,4-5"), as a sorted tuple."""
    want = 'None, a list of CPU numbers or a cpulist such as "2,4-5"'
    if v is None:
        return None
    if isinstance(v, str):
        cpus: list[int] = []
        for part in v.replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
                raise ValueError(want)
            cpus += range(int(lo), int(hi or lo) + 1)
    elif isinstance(v, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v):
        cpus = list(v)
    else:
        raise ValueError(want)
    if not cpus:
        raise ValueError(want)
    return tuple(sorted(set(cpus)))


@dataclass(frozen=True)
class LoopbackOptions:
    threads: int
    notify_dir: str | None
    min_split_bytes: int
    ptrace_grant: str
    inline_bytes: int
    copy_cpus: tuple[int, ...] | None


def parse_options(options: Mapping[str, Any]) -> LoopbackOptions:
    """The checked options; unknown or ill-typed ones raise ``BackendOptionError``.

    With ``copy_cpus`` set, every copy runs there unless told otherwise: ``threads``
    defaults to min(2, its CPUs) and ``inline_bytes`` to 0 (no copy on the posting
    thread, which is the engine's: keeping copies off its CPU is what the option is for)."""
    values = SCHEMA.parse(options)
    cpus = values["copy_cpus"]
    if cpus is not None:
        if "threads" not in options:
            values["threads"] = min(2, len(cpus))
        if "inline_bytes" not in options:
            values["inline_bytes"] = 0
    return LoopbackOptions(**values)
