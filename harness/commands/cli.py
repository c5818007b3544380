"""`ring-harness` command line: subcommands dispatch to modules under harness/commands/.

Exit codes: 0 all cases pass, 1 a case fails, 2 bad usage or bad input (one clear line)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from harness import interrupt
from harness.errors import HarnessError, Interrupted

COMMANDS = {
    "check": ("harness.commands.check", "run the default battery against an implementation"),
    "replay": (
        "harness.commands.replay",
        "re-run a saved case file and compare with its recorded result",
    ),
    "impls": (
        "harness.commands.impls",
        "list the implementations this install knows and their capabilities",
    ),
    "selftest": (
        "harness.commands.selftest",
        "run the default check against every mutant: kill matrix, false alarms",
    ),
    "bench": (
        "harness.commands.bench",
        "benchmark the harness and the reference ring (ratios, targets, MET/MISSED)",
    ),
    "profile": (
        "harness.commands.profile",
        "does a ring keep its promises: memory O(n/W), bytes at the minimum, overlap",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ring-harness",
        description="Correctness and fault-injection harness for ring attention.",
    )
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
    # SIGINT and SIGTERM (CI cancellation, `timeout`) only set a flag (harness.interrupt): the
    # command stops at its next safe point, writes what finished and closes its ranks; a second one
    # of the same kind ends it at once
    with interrupt.handlers():
        try:
            code = int(importlib.import_module(args._module).run(args))
        except Interrupted as e:
            code = interrupt.EXIT_CODES.get(e.signal, 1)
        except HarnessError as e:
            # under torchrun every rank says it: name the rank (torchrun's own status is 1)
            rank = f"rank {os.environ['RANK']}: " if "TORCHELASTIC_RUN_ID" in os.environ else ""
            print(f"ring-harness: {rank}error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("ring-harness: interrupted", file=sys.stderr)
            return 130
        stopped = interrupt.requested()
    if stopped is not None:
        print(
            f"ring-harness: interrupted ({stopped}); exit {interrupt.EXIT_CODES[stopped]}",
            file=sys.stderr,
        )
        return interrupt.EXIT_CODES[stopped]
    return code


# the commands that start a local pool of CPU ranks
POOL_COMMANDS = ("check", "selftest", "replay", "profile")


def _prestart(argv: list[str]) -> None:
    """Start the ranks' zygote while this process imports the command (harness.ranks.zygote)."""
    if not argv or argv[0] not in POOL_COMMANDS or {"-h", "--help"} & set(argv):
        return
    if "torchrun" in argv or "cuda" in argv or os.environ.get("RING_HARNESS_DEVICE") == "cuda":
        return
    from harness.ranks import zygote

    zygote.prestart()


def entry() -> None:
    """The `ring-harness` console script and `python -m harness`: `main`, then exit. A command
    stopped by a signal has closed its ranks and written what finished; it exits at once, without
    the interpreter's slow teardown (torch's takes seconds on a loaded machine, and whoever sent
    SIGTERM is waiting)."""
    _prestart(sys.argv[1:])
    code = main()
    if code in interrupt.EXIT_CODES.values():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
