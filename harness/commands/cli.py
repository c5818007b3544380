"""`ring-harness` command line: subcommands dispatch to modules under harness/commands/.

Exit codes: 0 all cases pass, 1 a case fails, 2 bad usage or bad input (one clear line)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from harness.errors import HarnessError

COMMANDS = {
    "check": ("harness.commands.check", "run the default battery against an implementation"),
    "replay": ("harness.commands.replay", "re-run a saved case file and compare with its recorded result"),
    "impls": ("harness.commands.impls", "list the implementations this install knows and their capabilities"),
    "selftest": ("harness.commands.selftest", "run the default check against every mutant: kill matrix, false alarms"),
    "bench": ("harness.commands.bench", "benchmark the harness and the reference ring (ratios, targets, MET/MISSED)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ring-harness",
                                description="Correctness and fault-injection harness for ring attention.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sp)
        sp.set_defaults(_module=module)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    previous = signal.signal(signal.SIGTERM, _terminated)  # CI cancellation and `timeout` send SIGTERM
    try:
        return int(importlib.import_module(args._module).run(args))
    except _Terminated:
        print("ring-harness: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except HarnessError as e:
        print(f"ring-harness: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ring-harness: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Terminated(SystemExit):
    """SIGTERM as an exception: context managers close the rank pool (and remove its temp dir) and
    the checks write what finished (`--json`) on the way out."""


def _terminated(signum, frame) -> None:
    raise _Terminated(143)


if __name__ == "__main__":
    sys.exit(main())
