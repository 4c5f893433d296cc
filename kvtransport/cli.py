"""``kvtransport`` command line: ``backends`` (what is installed and usable here),
``bench`` (the main job: prefill and decode processes moving a paged KV cache) and
``doctor`` (can this prefill / decode pair of vLLM engines move KV, and if not, why).

The bench job is its own package (``kvtransport_bench``) and the doctor lives in the vLLM
connector (``kvtransport_vllm.doctor``, it speaks the connector's side channel); each is
imported only when its command runs: the core library does not carry them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["main"]


def _cmd_backends(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .registry import available_backends

    infos = available_backends()
    if args.json:
        print(json.dumps([{"name": i.name, "usable": i.usable, "reason": i.reason,
                           "install_hint": i.install_hint, "version": i.version,
                           "entry_point": i.entry_point} for i in infos], indent=2))
        return 0
    table = Table(title="kvtransport backends (entry-point group kvtransport.backends)")
    for col in ("backend", "usable", "notes / reason", "install hint", "entry point"):
        table.add_column(col, overflow="fold")
    for i in infos:
        table.add_row(escape(i.name), "[green]yes[/]" if i.usable else "[red]no[/]",
                      escape(i.reason or "-"), escape(i.install_hint or "-"), escape(i.entry_point))
    Console(width=max(130, Console().width)).print(table)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from kvtransport_bench import BenchConfig, run_bench
    from kvtransport_bench.plot import PlotUnavailableError, require_matplotlib, write_plot

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


def _cmd_doctor(args: argparse.Namespace) -> int:
    return _doctor(args.doctor_args)


def _doctor(argv: list[str]) -> int:
    """Hand every argument to the doctor's own parser (so ``doctor --help`` is its help)."""
    try:
        from kvtransport_vllm.doctor import main as doctor_main
    except ImportError as exc:
        print(f"kvtransport: error: `kvtransport doctor` needs the vLLM connector (kvtransport_vllm) and vLLM "
              f"on this host ({exc}); run it on an engine host, or install vLLM and kvtransport[vllm]",
              file=sys.stderr)
        return 2
    return doctor_main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtransport", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("backends", help="list installed backends and whether they can run here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_cmd_backends)
    be = sub.add_parser("bench", help="move a paged KV cache between a prefill and a decode process")
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
    be.set_defaults(func=_cmd_bench)
    do = sub.add_parser("doctor", add_help=False,
                        help="check a prefill / decode pair: reach, secret, layouts, a block moved both ways "
                             "(`kvtransport doctor --help`)")
    do.add_argument("doctor_args", nargs=argparse.REMAINDER)
    do.set_defaults(func=_cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:
        return _doctor(argv[1:])
    args = build_parser().parse_args(argv)
    from .errors import KVTransportError

    try:
        return args.func(args)
    except KVTransportError as exc:
        print(f"kvtransport: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
