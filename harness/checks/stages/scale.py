"""The scale stage: seven cases at training sizes (their shapes: harness.search.scale).

Each case runs once, with the leak run. It is not repeated: the battery's repeat check covers state
carried between calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.case import Case
from harness.checks import report
from harness.checks.options import CheckOptions
from harness.context import Capabilities
from harness.runner import run_case
from harness.search.scale import scale_cases

if TYPE_CHECKING:
    from harness.checks.check import Check

name = "scale"  # the stage's name (harness.checks.stages.Stage)


def plan(opts: CheckOptions, caps: Capabilities) -> list[Case]:
    """The scale stage's cases for `opts` (none with --no-scale)."""
    if not opts.scale:
        return []
    return scale_cases(caps, opts.impl, opts.dtype, opts.deadline)


def ranks(opts: CheckOptions, caps: Capabilities) -> int:
    """Ranks to run every scale case without restarting (0 with --no-scale)."""
    return max((c.pool_size for c in plan(opts, caps)), default=0)


def run(check: Check) -> bool:
    """Run the scale stage into `check.outcome`. True: the check stops at one of its failures."""
    opts, caps, pool, out = check.opts, check.caps, check.pool, check.reporter
    cases = plan(opts, caps)
    if not cases:
        return False
    fit = [c for c in cases if c.pool_size <= pool.capacity]
    if len(fit) < len(cases):
        n = len(cases) - len(fit)
        out(
            f"scale stage: skipping {n} case(s) that need more than the {pool.capacity} ranks started"
        )
    tiles = ", ".join(map(str, caps.tiles))
    out(
        f"scale stage: {len(fit)} cases at training sizes (kernel tiles {tiles}: local lengths "
        "past 1, 2 and 4 tiles; positions past bf16's 256 and fp16's 2048; head_dim 64-128, GQA, "
        "batch)"
    )
    for i, c in enumerate(fit, 1):
        r = run_case(c, pool, opts.impl, allow_import=opts.allow_import)
        check.outcome.scale_results.append(r)
        check.outcome.cases += 1
        out(report.row(i, len(fit), r))
        for line in report.details(r):
            out(line)
        if not r.passed:
            check.save_failure(r)
            if check.record_failure(name, r):
                n, failing = len(check.outcome.scale_results), len(check.outcome.failures)
                return check.stop(f"stopped at scale stage case {n} ({failing} failing)")
    return False
