"""`ring-harness bench`: the benchmark figures, each printed with its ratio, target and MET/MISSED.

Exit 0 when every figure ran (missed targets are results, not errors), 2 on bad usage."""

from __future__ import annotations

import argparse
import importlib
import time

from harness import outputs
from harness.bench import FIGURES
from harness.bench.timing import Figure, load_line
from harness.checks import report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true", help="small sizes and few repeats (a smoke test, minutes)"
    )
    p.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        choices=list(FIGURES),
        help=f"run only this figure (repeatable): {', '.join(FIGURES)}",
    )
    p.add_argument("--json", metavar="FILE", help="write every figure's numbers here")


def run_figure(name: str, quick: bool) -> Figure:
    """Import and run one figure, recording how long it took."""
    t0 = time.perf_counter()
    fig = importlib.import_module(FIGURES[name]).run(quick)
    fig.seconds = time.perf_counter() - t0
    return fig


def run(args: argparse.Namespace) -> int:
    names = args.only or list(FIGURES)
    outputs.check_file(args.json, "--json")
    report.out(f"ring-harness bench{' --quick' if args.quick else ''}: {', '.join(names)}")
    report.out(load_line())
    figures = []
    for name in names:
        fig = run_figure(name, args.quick)
        figures.append(fig)
        for line in fig.render():
            report.out(line)
        report.out(f"    ({fig.seconds:.0f} s)")
    targets = [t for f in figures for t in f.targets]
    met = sum(t.met for t in targets)
    report.out(
        f"{met}/{len(targets)} targets met"
        + (
            ""
            if met == len(targets)
            else ": missed "
            + "; ".join(f"{f.name}: {t.label}" for f in figures for t in f.targets if not t.met)
        )
    )
    if args.json:
        report.write_json(
            args.json,
            {"command": "bench", "quick": args.quick, "figures": [f.to_dict() for f in figures]},
        )
    broken = [f"{f.name}: {t.label}" for f in figures for t in f.targets if t.value != t.value]
    # a figure that measured nothing (NaN) did not run
    if broken or not all(f.targets for f in figures):
        empty = [f.name for f in figures if not f.targets]
        report.out("bench FAILED: no measurement for " + "; ".join(broken or empty))
        return 1
    return 0
