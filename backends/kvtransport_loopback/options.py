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
)


@dataclass(frozen=True)
class LoopbackOptions:
    threads: int
    notify_dir: str | None
    min_split_bytes: int
    ptrace_grant: str
    inline_bytes: int


def parse_options(options: Mapping[str, Any]) -> LoopbackOptions:
    """The checked options; unknown or ill-typed ones raise ``BackendOptionError``."""
    return LoopbackOptions(**SCHEMA.parse(options))
