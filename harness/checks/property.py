"""Command-line glue for the property-based run: its options, progress, report lines and plots
(shared by `ring-harness check` and `ring-harness replay`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.checks import report
from harness.checks.progress import FuzzProgress
from harness.diagnose import localise
from harness.errors import HarnessError
from harness.runner import CaseResult
from harness.search import fuzz


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The property-based options of `check`."""
    p.add_argument("--profile", choices=sorted(fuzz.PROFILES), default="ci",
                   help="hypothesis profile: ci = derandomised, fixed budget (default); nightly = random, large budget")
    p.add_argument("--max-examples", type=int, default=None, metavar="N",
                   help="property-based examples (0 = battery only; default: the profile's, ci "
                        f"{fuzz.PROFILES['ci'].max_examples})")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="seconds of property-based search (default: the profile's, ci "
                        f"{fuzz.PROFILES['ci'].time_budget_s:g}); shrinking a failure gets up to "
                        f"{fuzz.PROFILES['ci'].shrink_budget_s:g} s more")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="hypothesis seed (default: 0 for ci, random and printed for nightly)")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write error heatmaps (PNG) of failing cases here (needs matplotlib)")


def check_options(args: argparse.Namespace) -> None:
    """Reject bad values with one clear line (exit 2)."""
    if args.max_examples is not None and args.max_examples < 0:
        raise HarnessError(f"--max-examples must be >= 0, got {args.max_examples}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise HarnessError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise HarnessError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.plot:
        from harness.diagnose.plot import _pyplot

        _pyplot()  # fail before the run, not after it, when matplotlib is missing


def run_property(args: argparse.Namespace, pool, impl: str, allow_import: bool, backend: str,
                 failed: list[CaseResult] = ()) -> fuzz.FuzzOutcome:
    """The property-based part of `check`, with progress and a report; with --plot, heatmaps of the
    shrunk failure (or of the first failed battery case, `failed`, when the search found none)."""
    prof = fuzz.PROFILES[args.profile]
    n = prof.max_examples if args.max_examples is None else args.max_examples
    budget = prof.time_budget_s if args.time_budget is None else args.time_budget
    caps, version = fuzz.impl_info(impl, allow_import)
    from harness.search import strategies

    strategy = strategies.cases(caps, impl=impl, pool_size=pool.size, max_world=pool.size,
                                deadline_s=args.deadline or 60.0)
    seed_note = "" if args.seed is not None or prof.derandomize else " (random; pass --seed to repeat)"
    with FuzzProgress(n, budget) as bar:
        out = fuzz.fuzz(impl, pool, profile=args.profile, max_examples=n, time_budget_s=budget, seed=args.seed,
                        caps=caps, save_dir=args.save_dir, allow_import=allow_import, strategy=strategy,
                        progress=bar, impl_version=version, backend=backend)
    report.out(f"property-based: profile {out.profile}, seed {out.seed}{seed_note}")
    for line in outcome_lines(out):
        report.out(line)
    paths: list[Path] = []
    if args.plot and out.localisation is not None and out.localisation.blocks:
        paths = plot(out.localisation, args.plot, out.shrunk_path.stem)
    elif args.plot and failed:
        paths = plot_result(failed[0], pool, args.plot, f"battery-{failed[0].case.key()}")
    for p in paths:
        report.out(f"        heatmap {p}")
    return out


def outcome_lines(out: fuzz.FuzzOutcome) -> list[str]:
    """What the property-based run did: counts, rate, and the saved/shrunk failure with where it is."""
    lines = [f"property-based: {out.examples} examples, {out.runs} runs in {out.seconds:.1f} s "
             f"({out.rate_per_min():.0f} cases/min), {out.failures} failing runs; stop: {out.stop}"]
    if out.found is None:
        return lines
    lines.append(f"    first failure at example {out.first_failure_example} after {out.first_failure_s:.1f} s: "
                 f"{out.found.verdict}: {out.found.case.summary()}")
    lines.append(f"        saved {out.found_path}")
    r = out.shrunk
    lines.append(f"    shrunk to: {r.verdict}: {r.case.summary()}")
    lines.extend(report.details(r))
    if out.localisation is not None:
        lines.extend(localise.lines(out.localisation))
    if out.reference_verdict is not None:
        lines.append(f"        same case on the reference: {out.reference_verdict}")
        if out.reference_verdict != "pass":
            lines.append("        WARNING: the reference fails this case too: suspect the harness (tolerance, "
                         "oracle) before the implementation")
    lines.append(f"        saved {out.shrunk_path}")
    return lines


def outcome_json(out: fuzz.FuzzOutcome) -> dict:
    """Machine-readable summary (for --json and selftest)."""
    return {
        "profile": out.profile, "seed": out.seed, "examples": out.examples, "runs": out.runs,
        "failures": out.failures, "seconds": out.seconds, "cases_per_min": out.rate_per_min(), "stop": out.stop,
        "first_failure_example": out.first_failure_example, "first_failure_s": out.first_failure_s,
        "found": None if out.found is None else out.found.to_dict(),
        "found_path": str(out.found_path) if out.found_path else None,
        "shrunk": None if out.shrunk is None else out.shrunk.to_dict(),
        "shrunk_path": str(out.shrunk_path) if out.shrunk_path and out.found else None,
        "localisation": None if out.localisation is None else localise.summary(out.localisation),
        "reference_verdict": out.reference_verdict, "verdicts": dict(out.verdicts),
        "worst_pass_ratio": out.worst_pass_ratio,
    }


def plot(loc: localise.Localisation, directory: str | Path, stem: str) -> list[Path]:
    """Heatmaps of a localisation (lazy matplotlib import)."""
    from harness.diagnose.plot import heatmaps

    return heatmaps(loc, directory, stem)


def plot_result(r: CaseResult, pool, directory: str | Path, stem: str) -> list[Path]:
    """Localise one failing result with probes and write its heatmaps."""
    loc = localise.localise(r, pool)
    return plot(loc, directory, stem) if loc.blocks else []
