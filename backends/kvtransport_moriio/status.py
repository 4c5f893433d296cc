"""Map mori ``TransferStatus`` objects onto kvtransport's PENDING / DONE / FAILED.

One kvtransport transfer becomes one mori batch per region pair, each with its own
``TransferStatus``. The transfer is

* FAILED as soon as any batch failed (the reason carries mori's status code and
  message), *quiesced* only once no batch is still running: a sibling batch that is
  still in flight may land bytes, and the memory it touches must not be reused yet;
* PENDING while any batch is INIT or IN_PROGRESS;
* DONE when every batch succeeded.

mori's ``TransferStatus.Code()`` also advances its progress engine, so polling it is how
completions are discovered; it never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtransport.spi import PollResult

__all__ = ["classify", "all_settled", "code_name"]


def code_name(status: Any) -> str:
    """``StatusCode.ERR_RDMA_OP`` -> ``ERR_RDMA_OP`` (works for pybind11 enums and ints)."""
    code = status.Code()
    name = getattr(code, "name", None)
    return str(name if name is not None else code)


def _running(status: Any) -> bool:
    return bool(status.InProgress() or status.Init())


def all_settled(statuses: Sequence[Any]) -> bool:
    """True when no batch can still move bytes (each succeeded or failed)."""
    return not any(_running(s) for s in statuses)


def classify(statuses: Sequence[Any], peer_name: str) -> PollResult:
    """The kvtransport state of a transfer made of ``statuses`` (one per region pair)."""
    running = False
    failure: str | None = None
    for i, s in enumerate(statuses):
        if s.Failed():
            if failure is None:
                msg = s.Message() or "no message"
                failure = (
                    f"mori batch {i + 1}/{len(statuses)} to peer {peer_name!r} failed: "
                    f"{code_name(s)}: {msg}"
                )
        elif not s.Succeeded():
            running = True
    if failure is not None:
        return PollResult.failed(failure, quiesced=not running)
    if running:
        return PollResult.pending()
    return PollResult.done()
