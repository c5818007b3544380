"""One run, as the report's grouping and shared-feature line read it: its case, its cause, its ranks.

It keeps no tensors, so a check can hold one for every case it ran, shrink runs included.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.case import Case
from harness.judging.verdicts import FORWARD, failure_signature
from harness.result import CaseResult


@dataclass(frozen=True)
class RunRecord:
    """A case and how it ended. `cause` is empty for a pass; `ranks` are the wrong ring ranks."""

    case: Case
    stage: str
    cause: tuple[str, ...] = ()
    ranks: frozenset[int] = frozenset()

    @property
    def passed(self) -> bool:
        return not self.cause


def record_of(r: CaseResult, stage: str) -> RunRecord:
    """The record of one result. A wrong forward names the ranks whose out or lse is wrong."""
    if r.passed:
        return RunRecord(r.case, stage)
    failed = r.failed_checks()
    forward = [c for c in failed if c.tensor in FORWARD]
    ranks = frozenset(c.rank for c in (forward or failed))
    return RunRecord(r.case, stage, failure_signature(r), ranks)
