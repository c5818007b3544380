"""The property-based stage of the default check: the search of harness.search.fuzz on the ranks.

This module gives it its budget from the options, its progress bar, its report lines and its
plots. `replay` shares the heatmaps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from harness.checks import report
from harness.checks.options import CheckOptions
from harness.checks.progress import FuzzProgress
from harness.checks.report import Reporter
from harness.diagnose import localise
from harness.impls.capabilities import without_inference, without_variants
from harness.result import Verdict
from harness.search import explore, fuzz, strategies

if TYPE_CHECKING:
    from harness.checks.check import Check
    from harness.context import Capabilities

name = "property"  # the stage's name (harness.checks.stages.Stage)


def ranks(opts: CheckOptions, caps: Capabilities) -> int:
    """None of its own: it draws cases that fit the pool it gets."""
    return 0


def run(check: Check) -> bool:
    """Run the property-based search into `check.outcome` and record its failure, if it found one.

    The failure is recorded at the example and the time at which the search first met it. It never
    stops the check: it is the last stage.
    """
    outcome = check.outcome
    before, t0 = outcome.cases, check.elapsed()
    p = outcome.prop = run_property(check.opts, check.pool, reporter=check.reporter)
    outcome.cases += p.examples
    if p.found is not None:
        check.record_failure(name, p.found, p.shrunk)
        f = outcome.failures[-1]
        f.cases = before + (p.first_failure_example or 0)
        f.seconds = t0 + (p.first_failure_s or 0.0)
    return False


def run_property(opts: CheckOptions, pool, reporter: Reporter | None = None) -> fuzz.FuzzOutcome:
    """The property-based part of `check`, with progress and a report.

    With opts.plot, it writes heatmaps of each cause's shrunk failure. The other stages plot their
    saved failures as they save them (harness.checks.check).
    """
    out_line = reporter or report.out
    impl, allow_import, backend = opts.impl, opts.allow_import, pool.backend
    prof = fuzz.PROFILES[opts.profile]
    n = prof.max_examples if opts.max_examples is None else opts.max_examples
    budget = prof.time_budget_s if opts.time_budget is None else opts.time_budget
    caps, version = fuzz.impl_info(impl, allow_import)
    if not opts.variants:
        caps = without_variants(caps)
    if not opts.inference:
        caps = without_inference(caps)
    # --dtype shapes every stage: draw only cases of that dtype.
    if opts.dtype is not None:
        caps = dataclasses.replace(caps, dtypes=frozenset({opts.dtype}))
    strategy = strategies.cases(
        caps,
        impl=impl,
        pool_size=pool.capacity,
        max_world=pool.capacity,
        deadline_s=opts.deadline or 60.0,
        sizes=prof.sizes if opts.scale else None,
        model_calls=opts.model_calls,
    )
    seed_note = (
        "" if opts.seed is not None or prof.derandomize else " (random; pass --seed to repeat)"
    )
    with FuzzProgress(n, budget, stream=out_line.stream) as bar:
        out = fuzz.fuzz(
            impl,
            pool,
            profile=opts.profile,
            max_examples=n,
            time_budget_s=budget,
            seed=opts.seed,
            caps=caps,
            save_dir=opts.save_dir,
            allow_import=allow_import,
            strategy=strategy,
            progress=bar,
            impl_version=version,
            backend=backend,
            explore_examples=explore.EXAMPLES,
        )
    out_line(f"property-based: profile {out.profile}, seed {out.seed}{seed_note}")
    for line in outcome_lines(out):
        out_line(line)
    paths: list[Path] = []
    for bug in out.bugs if opts.plot else ():
        if bug.localisation is not None and bug.localisation.blocks:
            paths += plot(bug.localisation, opts.plot, bug.shrunk_path.stem)
    for p in paths:
        out_line(f"        heatmap {p}")
    return out


def outcome_lines(out: fuzz.FuzzOutcome) -> list[str]:
    """What the property-based run did: counts, rate, and the saved and shrunk failure with where it
    is.
    """
    lines = [
        f"property-based: {out.examples} examples, {out.runs} runs in {out.seconds:.1f} s "
        f"({out.rate_per_min():.0f} cases/min), {out.failures} failing runs; stop: {out.stop}"
    ]
    if out.found is None:
        return lines
    first = out.bugs[0] if out.bugs else None
    lines.append(
        f"    first failure at example {out.first_failure_example} after "
        f"{out.first_failure_s:.1f} s"
    )
    which = (
        f" (of {len(out.bugs)} failure causes, the one that shrank smallest)"
        if len(out.bugs) > 1
        else ""
    )
    lines.append(f"    found{which}: {out.found.verdict}: {out.found.case.summary()}")
    # its fresh-rank confirmation (harness.search.history)
    if first is not None and first.history is not None:
        lines.extend(first.history.lines())
    lines.append(f"        saved {out.found_path}")
    if out.refused:
        lines.append(
            f"    shrinking refused {out.refused} candidate(s) that failed on the warm "
            "ranks but not alone "
            "on fresh ones"
        )
    r = out.shrunk
    seq = first.history.sequence if first is not None and first.history is not None else None
    if seq is not None:
        lines.append(
            f"    shrunk to: {r.verdict}: {seq.summary()} (a sequence of {len(seq.steps)} cases)"
        )
    else:
        lines.append(f"    shrunk to: {r.verdict}: {r.case.summary()}")
    lines.extend(report.details(r))
    if out.localisation is not None:
        lines.extend(localise.lines(out.localisation))
    if out.reference_verdict is not None:
        lines.append(f"        same case on the reference: {out.reference_verdict}")
        if out.reference_verdict != Verdict.PASS:
            lines.append(
                "        WARNING: the reference fails this case too: suspect the harness "
                "(tolerance, "
                "oracle) before the implementation"
            )
    lines.append(f"        saved {out.shrunk_path}")
    return lines


def property_json(out: fuzz.FuzzOutcome) -> dict:
    """A machine-readable summary, for --json and selftest."""
    return {
        "profile": out.profile,
        "seed": out.seed,
        "examples": out.examples,
        "runs": out.runs,
        "failures": out.failures,
        "seconds": out.seconds,
        "cases_per_min": out.rate_per_min(),
        "stop": out.stop,
        "first_failure_example": out.first_failure_example,
        "first_failure_s": out.first_failure_s,
        "found": None if out.found is None else out.found.to_dict(),
        "found_path": str(out.found_path) if out.found_path else None,
        "shrunk": None if out.shrunk is None else out.shrunk.to_dict(),
        "shrunk_path": str(out.shrunk_path) if out.shrunk_path and out.found else None,
        "localisation": None if out.localisation is None else localise.summary(out.localisation),
        "reference_verdict": out.reference_verdict,
        "verdicts": dict(out.verdicts),
        "worst_pass_ratio": out.worst_pass_ratio,
    }


def plot(loc: localise.Localisation, directory: str | Path, stem: str) -> list[Path]:
    """Heatmaps of a localisation. matplotlib is imported lazily."""
    from harness.diagnose.plot import heatmaps

    return heatmaps(loc, directory, stem)
