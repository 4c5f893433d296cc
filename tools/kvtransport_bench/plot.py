"""The ``--plot`` picture: throughput per mode and latency percentiles.

matplotlib is an optional extra (``kvtransport[plot]``; ``scripts/dev.sh bench --plot``
installs it). :func:`require_matplotlib` is called before the run starts, so a missing
install fails at once with the fix, not after minutes of measuring.
"""

from __future__ import annotations

from typing import Any

from .config import BenchConfig, ModeResult

__all__ = ["PlotUnavailableError", "require_matplotlib", "write_plot"]

INSTALL_HINT = "pip install 'kvtransport[plot]' (./scripts/dev.sh bench --plot installs it)"


class PlotUnavailableError(RuntimeError):
    """--plot was asked for but matplotlib cannot be imported."""


def require_matplotlib() -> Any:
    """Import matplotlib's pyplot on the file-only Agg backend, or raise with the fix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailableError(f"--plot needs matplotlib ({exc}): {INSTALL_HINT}") from None
    return plt


def write_plot(results: list[ModeResult], cfg: BenchConfig, path: str) -> None:
    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    modes = [r.mode.upper() for r in results]
    ax1.bar(modes, [r.gbps for r in results], color=["tab:blue", "tab:orange"][: len(results)])
    ax1.set_ylabel("GB/s")
    ax1.set_title(f"{cfg.backend}: throughput")
    for i, r in enumerate(results):
        ax2.plot(["p50", "p90", "p99"], [r.latency_ms[p] for p in ("p50", "p90", "p99")], marker="o",
                 label=modes[i])
    ax2.set_ylabel("ms per request")
    ax2.set_title(f"latency ({cfg.request_bytes / 2**20:.0f} MiB/request)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
