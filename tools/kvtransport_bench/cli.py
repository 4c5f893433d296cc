"""``kvtransport bench``: the command line of the bench job.

Registered with the ``kvtransport`` command through the ``kvtransport.commands`` entry-point
group, so the core package never imports the job: ``kvtransport bench ARGS`` calls
:func:`main` with ``ARGS``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvtransport.errors import KVTransportError

from .config import BenchConfig
from .job import run_bench
from .plot import PlotUnavailableError, require_matplotlib, write_plot

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    be = argparse.ArgumentParser(prog="kvtransport bench", description="move a paged KV cache between a prefill "
                                 "and a decode process, verify every byte, print GB/s and latency percentiles")
    be.add_argument("--backend", default="loopback")
    be.add_argument("--backend-options", default=None, metavar="JSON", help='e.g. \'{"tls": "tcp"}\'')
    be.add_argument("--mode", choices=("read", "write", "both"), default="both")
    be.add_argument("--layers", type=int, default=32)
    be.add_argument("--num-blocks", type=int, default=128, help="blocks per layer")
    be.add_argument("--block-bytes", type=int, default=32 * 1024, help="bytes of one K (or V) block")
    be.add_argument("--blocks-per-request", type=int, default=32)
    be.add_argument("--requests", type=int, default=16)
    be.add_argument("--warmup", type=int, default=2)
    be.add_argument("--timeout", type=float, default=60.0, help="deadline of each transfer, seconds")
    be.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    be.add_argument("--plot", metavar="FILE.png", default=None,
                    help="also draw throughput and latency to this PNG (needs the 'plot' extra: matplotlib)")
    return be


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table


    if args.plot:
        # Checked before the run: a missing extra fails now, not after the measurement.
        try:
            require_matplotlib()
        except PlotUnavailableError as exc:
            print(f"kvtransport: error: {exc}", file=sys.stderr)
            return 2
    opts: dict[str, Any] = json.loads(args.backend_options) if args.backend_options else {}
    modes = ("read", "write") if args.mode == "both" else (args.mode,)
    cfg = BenchConfig(backend=args.backend, backend_options=opts, layers=args.layers,
                      num_blocks=args.num_blocks, block_bytes=args.block_bytes,
                      blocks_per_request=args.blocks_per_request, requests=args.requests,
                      warmup=args.warmup, modes=modes, timeout_s=args.timeout)
    if cfg.blocks_per_request > cfg.num_blocks:
        print("error: --blocks-per-request must not exceed --num-blocks", file=sys.stderr)
        return 2
    console = Console(stderr=args.json, width=max(110, Console().width))
    console.print(f"[bold]kvtransport bench[/]: backend={cfg.backend} layers={cfg.layers} "
                  f"blocks={cfg.num_blocks} block={cfg.block_bytes // 1024} KiB x K,V; "
                  f"{cfg.blocks_per_request} scattered blocks/request = "
                  f"{cfg.request_bytes / 2**20:.1f} MiB; cache {cfg.layers * cfg.layer_bytes / 2**20:.0f} MiB/side")
    total = (cfg.requests + cfg.warmup) * len(modes)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=args.json) as progress:
        task = progress.add_task("starting prefill + decode", total=total)

        def on_step(mode: str, measured: bool) -> None:
            progress.update(task, advance=1, description=f"{mode.upper()} {'' if measured else '(warm-up)'}")

        results, stats = run_bench(cfg, on_step)
    failed = sum(r.failed for r in results)
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(cfg).items() if k != "secret"},
                          "results": [vars(r) for r in results], "decode_agent_stats": stats}, indent=2))
    else:
        table = Table(title=f"{cfg.backend}: prefill <-> decode, every byte verified")
        for col in ("mode", "requests", "MiB/request", "GB/s", "p50 ms", "p90 ms", "p99 ms",
                    "blocks verified", "failed"):
            table.add_column(col, justify="right")
        for r in results:
            table.add_row(r.mode.upper(), str(r.requests), f"{r.bytes_per_request / 2**20:.1f}",
                          f"{r.gbps:.2f}", *(f"{r.latency_ms[p]:.2f}" for p in ("p50", "p90", "p99")),
                          str(r.verified_blocks), str(r.failed))
        console.print(table)
    if args.plot:
        write_plot(results, cfg, args.plot)
        console.print(f"plot written to {args.plot}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    """Run the job with ``argv`` (the words after ``kvtransport bench``): 0 every byte
    verified, 1 a transfer failed, 2 bad arguments or a library error (printed)."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KVTransportError as exc:
        print(f"kvtransport: error: {exc}", file=sys.stderr)
        return 2
