"""``kvtransport`` command line.

``kvtransport backends`` (what is installed and usable here) is the core's own command.
Every other command is found by name in the entry-point group ``kvtransport.commands``, the
way backends are found in ``kvtransport.backends``: the bench job (``kvtransport_bench``)
and the vLLM connector's doctor (``kvtransport_vllm``) register theirs, and the core never
imports a package above it. A command's entry point is a ``main(argv) -> int`` that parses
its own arguments, so ``kvtransport doctor --help`` is the doctor's own help. A command
whose package cannot be imported here is still listed, and running it says why."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

__all__ = ["main", "COMMANDS_GROUP"]

#: entry-point group of the ``kvtransport`` subcommands other than ``backends``
COMMANDS_GROUP = "kvtransport.commands"


def _cmd_backends(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtransport backends",
                                description="list installed backends and whether they can run here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

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


def _registered() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _usage(commands: list[str]) -> str:
    return (f"usage: kvtransport {{{','.join(commands)}}} [ARGS...]\n"
            "  backends  list installed backends and whether they can run here\n"
            f"  other commands come from the '{COMMANDS_GROUP}' entry points; `kvtransport COMMAND --help`")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    registered = _registered()
    commands = ["backends", *sorted(registered)]
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(commands), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "backends":
        return _cmd_backends(rest)
    ep = registered.get(name)
    if ep is None:
        print(f"kvtransport: error: unknown command {name!r}; commands here: {', '.join(commands)}",
              file=sys.stderr)
        return 2
    try:
        command: Callable[[list[str]], int] = ep.load()
    except ImportError as exc:
        print(f"kvtransport: error: `kvtransport {name}` cannot run on this host: its package does not "
              f"import ({exc}; entry point {ep.value}); install what it needs (doctor: vLLM and "
              f"kvtransport[vllm], on an engine host)", file=sys.stderr)
        return 2
    return command(rest)


if __name__ == "__main__":
    sys.exit(main())
