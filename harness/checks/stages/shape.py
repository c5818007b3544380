"""The shape stage (`check --shape`): the growth check, then the basics, at the user's shape.

Each basic runs once, with the leak run. The estimate comes first. A plan that cannot fit or that
exceeds --shape-budget is refused in one line. harness.checks.shape holds the shape, its plan and
the estimate.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from harness.case import Case
from harness.checks import report
from harness.checks import shape as shape_mod
from harness.checks.options import CheckOptions
from harness.checks.stages import growth
from harness.context import Capabilities
from harness.oracle import cache
from harness.runner import run_case

if TYPE_CHECKING:
    from harness.checks.check import Check

name = "shape"  # the stage's name (harness.checks.stages.Stage)


def plan(
    opts: CheckOptions, caps: Capabilities, pool_size: int | None = None
) -> tuple[shape_mod.ShapePlan, shape_mod.Estimate]:
    """(the user's shape plan with its runs' deadlines, its estimate).

    Refused in one line when it cannot fit or exceeds --shape-budget.
    """
    p = shape_mod.plan(shape_mod.parse_shape(opts.shape), caps, opts.impl, opts.dtype, pool_size)
    if not opts.growth:
        p.growth = []
    rates = shape_mod.Rates.measure()
    est = shape_mod.estimate(p, rates)
    shape_mod.refuse_or_accept(p, est, opts.shape_budget, opts.dtype)

    def timed(c: Case) -> Case:
        return c.replace(deadline_s=opts.deadline or shape_mod.deadline(c, rates))

    p.basics = [timed(c) for c in p.basics]
    p.growth = [{w: timed(c) for w, c in g.items()} for g in p.growth]
    return p, est


def ranks(opts: CheckOptions, caps: Capabilities) -> int:
    """The shape's ring size. The estimate, or the refusal, comes before any rank starts."""
    return plan(opts, caps)[0].shape.world_size


def _growth(check: Check, p: shape_mod.ShapePlan) -> bool:
    """The growth check at the user's shape. True: the check stops at one of its failures."""
    t0 = time.perf_counter()
    if p.growth:
        planned = (p.growth_worlds, p.growth)
        g = growth.growth_check(check.pool, check.opts, check.caps, check.reporter, planned=planned)
        check.outcome.growth = g
        check.outcome.cases += sum(len(c.results) for c in g.cases)
        if growth.record_failures(check, g):
            return True
    check.outcome.stage_seconds["growth"] = time.perf_counter() - t0
    return False


def _basics(check: Check, basics: list[Case]) -> bool:
    """The layout x mask x dtype basics at the user's shape. True: the check stops at one."""
    opts, outcome, out = check.opts, check.outcome, check.reporter
    t0 = time.perf_counter()
    out(report.header())
    for i, c in enumerate(basics, 1):
        r = run_case(c, check.pool, opts.impl, allow_import=opts.allow_import)
        # Judged: its oracle outputs are not needed again.
        cache.forget(c)
        outcome.shape_results.append(r)
        outcome.cases += 1
        out(report.row(i, len(basics), r))
        for line in report.details(r):
            out(line)
        if not r.passed:
            check.save_failure(r)
            if check.record_failure(name, r):
                return True
    outcome.stage_seconds["shape basics"] = time.perf_counter() - t0
    return False


def run(check: Check) -> bool:
    """Run the shape stage into `check.outcome`, the estimate first. True: it stopped early."""
    out = check.reporter
    # A local pool grows to the shape's W: only a fixed pool's size limits the plan.
    fixed = None if hasattr(check.pool, "ensure") else check.pool.size
    p, est = plan(check.opts, check.caps, fixed)
    check.outcome.shape = p.shape.spec()
    growth_runs = sum(len(g) for g in p.growth)
    worlds = ", ".join(map(str, p.growth_worlds))
    out(
        f"shape {p.shape.spec()}: {len(p.basics)} basics (layout x mask x dtype) + {growth_runs} "
        f"growth-check runs (W {worlds}); estimate here: {est.words()}"
    )
    for line in p.left_out:
        out(f"    not declared, left out: {line}")
    return _growth(check, p) or _basics(check, p.basics)
