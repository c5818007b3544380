"""`ring-harness selftest`: the default check against every mutant of the reference ring (the kill
matrix) and against the reference itself (false alarms); see harness.checks.selftest.

Exit 0 when every mutant is killed and the reference passes, 1 otherwise, 2 on bad usage."""

from __future__ import annotations

import argparse
import dataclasses

from harness.checks.options import SelftestOptions
from harness.commands._args import add_placement, build, hint

S = argparse.SUPPRESS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        metavar="FILE",
        default=S,
        help="write the kill matrix and the false-alarm figures here",
    )
    p.add_argument(
        "--only",
        metavar="NAME,...",
        default=S,
        help="these mutants only (names as in ring_impl.mutants; 'reference' is the "
        "false-alarm run)",
    )
    p.add_argument(
        "--false-alarm-cases",
        type=int,
        default=S,
        metavar="N",
        help="property-based examples for the reference, with no time limit (default: "
        "the default "
        "check's budget)",
    )
    p.add_argument(
        "--save-dir",
        metavar="DIR",
        default=S,
        help="per-mutant check logs and found cases" + hint(SelftestOptions, "save_dir"),
    )
    add_placement(p)
    p.add_argument(
        "--corpus",
        default=S,
        metavar="DIR",
        help="write each mutant's minimal case here as mutant-NAME.yaml (e.g. cases/); "
        "default: --save-dir",
    )


def run(args: argparse.Namespace) -> int:
    from harness.checks.options import CheckOptions
    from harness.checks.selftest import selftest

    opts = build(SelftestOptions, args)
    opts = dataclasses.replace(
        opts,
        check=build(
            CheckOptions,
            argparse.Namespace(
                **{k: getattr(args, k) for k in ("device", "stage_p2p") if hasattr(args, k)}
            ),
        ),
    )
    return 0 if selftest(opts).passed else 1
