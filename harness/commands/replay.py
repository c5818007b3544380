"""`ring-harness replay CASE.yaml`: re-run a saved case (harness.checks.replay), say whether its
recorded verdict reproduces and whether the output hashes match the record bit for bit.
Exit 0 pass, 1 fail, 2 bad input."""

from __future__ import annotations

import argparse

from harness.checks.options import ORACLES, ReplayOptions
from harness.commands._args import add_placement, build

S = argparse.SUPPRESS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", metavar="CASE.yaml", help="a saved case file")
    p.add_argument(
        "--impl",
        default=S,
        help="run under this implementation instead of the case's (a built-in name or "
        "package.module:attr; "
        "a case file may only name one, so give module paths here)",
    )
    p.add_argument(
        "--plot", default=S, metavar="DIR", help="write error heatmaps (PNG) here if the case fails"
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), default=S, help="default: gloo")
    add_placement(p)
    p.add_argument("--json", metavar="FILE", default=S, help="write the replay result here")
    p.add_argument(
        "--oracle",
        choices=ORACLES,
        default=S,
        help="who computes the float64 oracle: ranks (the case's ranks, each its own query "
        "rows), local (this process) or auto (default: local for a small case on CPU ranks)",
    )


def run(args: argparse.Namespace) -> int:
    from harness.checks.replay import replay

    return 0 if replay(build(ReplayOptions, args)).correct else 1
