"""``kvtransport_bench``: the job behind ``kvtransport bench``.

A prefill and a decode process move a paged KV cache through a kvtransport backend, in
READ and WRITE modes, and verify every byte. The job is a user of the library, not part
of it, so it lives outside the core package (``kvtransport``), which imports it only
when the ``bench`` subcommand runs.

Modules, one job each:

* :mod:`.config` -- what to run (:class:`BenchConfig`) and what came out (:class:`ModeResult`);
* :mod:`.protocol` -- the side-channel messages between the two processes and the sealed
  request/reply channel that carries them;
* :mod:`.cache` -- the registered KV cache, its block layout and verifiable contents;
* :mod:`.job` -- the two processes and :func:`run_bench`, which starts and watches them;
* :mod:`.plot` -- the ``--plot`` picture (matplotlib, an optional extra).
"""

from __future__ import annotations

from .config import BenchConfig, ModeResult
from .job import run_bench

__all__ = ["BenchConfig", "ModeResult", "run_bench"]
