"""A failure group's headline: its smallest failing case, shrunk, keeping its cause.

The property-based run shrinks its failures; the battery, the scale stage and the phase after a
failure do not. So the group's smallest member, the property run's minimal case where it has one,
is shrunk greedily here (harness.search.shrink), within the experiments' budget and the declared
space. Each greedy round is followed by one rank fewer, each rank keeping its share: the shrinker
re-splits the tokens evenly and can miss it.
"""

from __future__ import annotations

import time

from harness.case import Case
from harness.checks.experiments import Lab, variants
from harness.impls.capabilities import unsupported
from harness.judging.run_record import RunRecord, record_of
from harness.result import CaseResult
from harness.search.shrink import case_size, shrink
from harness.search.signature import Signature

STAGE = "shrinking"
SHRINK_S, SHRINK_TRIES = 8.0, 40  # one headline's shrinking (tries: per greedy round)
MAX_DESCENTS = 3  # rounds of one rank fewer, each followed by greedy shrinking


def headline(
    members: list[RunRecord], shrunk: dict[str, CaseResult], lab: Lab
) -> tuple[RunRecord, RunRecord | None]:
    """(the group's shrunk smallest case, the member it was shrunk from here, if it was).

    `shrunk`: the property run's minimal failures by case key. One of them starts the shrinking
    when the group has one; else the smallest member does, run again for its result.
    """
    clean = [r for r in members if not r.case.faults] or members
    done = [r for r in clean if r.case.key() in shrunk]
    first = min(done or clean, key=lambda r: case_size(r.case))
    start = shrunk.get(first.case.key())
    if start is None:
        start = lab.result(first.case)
        lab.note(start, STAGE, first.case.key())
    if start.passed or lab.spent():
        return first, None
    best = _shrink(start, lab)
    # the same case, its deadline shortened for the lab (Lab.result): not shrunk
    if best.case.replace(deadline_s=first.case.deadline_s) == first.case:
        return first, None
    return record_of(best, STAGE), first


def _shrink(start: CaseResult, lab: Lab) -> CaseResult:
    """Greedy rounds and rounds of one rank fewer, keeping `start`'s signature, until none helps."""
    end = min(lab.until, time.monotonic() + SHRINK_S)

    def still_fails(c: Case) -> CaseResult | None:
        """A candidate's failure; None when it passes, is undeclared or the budget is spent."""
        known = lab.known.get(c.key())
        if time.monotonic() > end or (known is not None and known.passed):
            return None
        if c.pool_size > lab.capacity or unsupported(lab.caps, c):
            return None
        r = lab.result(c)
        lab.note(r, STAGE, c.key())
        return None if r.passed else r

    def greedy(r: CaseResult) -> CaseResult:
        budget = max(0.0, end - time.monotonic())
        return shrink(r, still_fails, budget_s=budget, max_tries=SHRINK_TRIES)[0]

    best = greedy(start)
    for _ in range(MAX_DESCENTS):
        down = [v for v in variants(best.case, lab.caps, lab.capacity) if v.feature == "world size"]
        if not down or not down[0].plainer:
            break
        r = still_fails(down[0].case)
        if r is None or Signature.of(r) != Signature.of(best):
            break
        best = greedy(r)
    return best
