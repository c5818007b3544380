"""After a failure, a few more drawn cases, run and recorded, never shrunk or saved.

Hypothesis stops searching at its first failure and shrinks it. The check's shared-feature line
(harness.checks.shared_features) then has little property-run data to tell failing from passing
cases. This phase draws EXAMPLES more cases from the same strategy with the run's seed, so the
same cases run on every machine. It stops at the first hang: a hang costs its deadline.
Each of its cases that a claim rests on is in the check's JSON: a failing one among its group's
`cases`, a passing one under the statistics condition it rules out. The group's first line comes
from experiments on its shrunk smallest case (harness.checks.experiments), not from these.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from harness.case import Case
from harness.judging.run_record import RunRecord, record_of
from harness.result import CaseResult, Verdict

EXAMPLES = 60
STAGE = "property, after the failure"


class _Hung(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Ends the phase at a hanging case."""


def explore(
    strategy: st.SearchStrategy[Case],
    execute: Callable[[Case], CaseResult],
    *,
    seed: int,
    examples: int = EXAMPLES,
    derandomize: bool = True,
) -> list[RunRecord]:
    """Run `examples` drawn cases and return their records (fewer when one hangs)."""
    seen: list[RunRecord] = []
    hyp = settings(
        max_examples=examples,
        derandomize=derandomize,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )

    def test(c: Case) -> None:
        r = execute(c)
        seen.append(record_of(r, STAGE))
        if r.verdict == Verdict.HANG:
            raise _Hung

    try:
        hypothesis_seed(seed + 1)(hyp(given(strategy)(test)))()
    except _Hung:
        pass
    return seen
