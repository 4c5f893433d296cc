"""Run code on a thread that may use one CPU only, as inside an engine pinned to one core.

vLLM on CPU pins each engine's threads with ``VLLM_CPU_OMP_THREADS_BIND``; every thread the
engine starts afterwards (a backend's copy or progress threads included) inherits that
one-CPU affinity. Backends size their thread pools by :func:`kvtransport.spi.usable_cpus`;
tests use :func:`call_on_one_cpu` to check what they pick there, without pinning the test
process itself (the affinity is set on a fresh thread and dies with it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_on_one_cpu(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread whose affinity is the first CPU this thread may use; its
    result is returned and its exception re-raised here."""
    cpu = min(os.sched_getaffinity(0))
    box: dict[str, object] = {}

    def run() -> None:
        os.sched_setaffinity(0, {cpu})  # 0 = the calling thread only
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    th = threading.Thread(target=run, name="kvt-one-cpu")
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
