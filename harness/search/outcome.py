"""What a property-based run did and found: how it ended, each distinct failure, the counts."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness.diagnose import localise as localise_mod
from harness.judging.run_record import RunRecord
from harness.result import CaseResult
from harness.search import history as history_mod
from harness.search.shrink import case_size
from harness.search.signature import Signature


class ExitReason(enum.Enum):
    """How a property-based run ended. Its value is the text reports show as `FuzzOutcome.stop`.

    A harness error and an interrupt are not exit reasons: they propagate out of `fuzz`.
    """

    NOTHING_REQUESTED = "no examples requested"
    MAX_EXAMPLES = "budget spent: no failure"
    EXHAUSTED = "search space exhausted"
    TIME_BUDGET = "time budget"
    FLAKY = "flaky: a failing case did not fail again when re-run"
    SHRUNK = "shrunk"
    SHRINK_SECONDS = "shrink budget ({seconds:.0f} s)"
    SHRINK_RUNS = "shrink budget ({runs} runs)"
    HISTORY_DEPENDENT = "history-dependent: shrunk as a sequence on fresh ranks"

    def describe(self, **budget: float | int | None) -> str:
        """The reason as text, with the budget it names (`seconds` or `runs`)."""
        return self.value.format(**budget)


@dataclass
class Bug:
    """One distinct failure (signature) of a property-based run.

    It is found, saved, shrunk and cross-checked.
    """

    signature: Signature
    found: CaseResult
    found_path: Path
    shrunk_path: Path
    example: int  # generated examples run when it was first seen
    seconds: float
    shrunk: CaseResult | None = None  # the smallest failing case of this signature so far
    failures: int = 0
    localisation: localise_mod.Localisation | None = None
    reference_verdict: str | None = None
    second_verdict: str | None = None
    # its fresh-rank confirmation (None: not confirmed)
    history: history_mod.HistoryFinding | None = None
    # each smaller-so-far failure while shrinking
    chain: list[CaseResult] = field(default_factory=list)

    @property
    def history_dependent(self) -> bool:
        return self.history is not None and self.history.history_dependent

    def best_size(self) -> tuple:
        """The size of its smallest failing case so far (shrink.case_size)."""
        return case_size((self.shrunk or self.found).case)

    @property
    def disagreement(self) -> bool:
        """'harness disagreement': the shrunk case fails on the reference or on SECOND_IMPL."""
        verdicts = (self.reference_verdict, self.second_verdict)
        return any(v not in (None, "pass", "unsupported") for v in verdicts)


@dataclass
class FuzzOutcome:
    """What a property-based run did and found."""

    impl: str
    profile: str
    seed: int
    examples: int = 0  # generated examples run (the search)
    runs: int = 0  # every case run, shrinking included
    found_at_run: int = 0  # `runs` when the first failure was found (shrink_runs counts from there)
    failures: int = 0  # failing runs, shrinking included
    seconds: float = 0.0
    first_failure_example: int | None = None
    first_failure_s: float | None = None
    found: CaseResult | None = None
    found_path: Path | None = None
    shrunk: CaseResult | None = None
    shrunk_path: Path | None = None
    localisation: localise_mod.Localisation | None = None
    reference_verdict: str | None = None  # the shrunk case on the reference implementation
    # the shrunk case on SECOND_IMPL; "unsupported" when it cannot run it
    second_verdict: str | None = None
    # every distinct failure (signature), in the order found
    bugs: list[Bug] = field(default_factory=list)
    refused: int = 0  # shrinking candidates that failed on the warm ranks only (not on fresh ones)
    confirmations: int = 0  # fresh-rank confirmation runs
    stop: str = ""  # how the run ended, as text: exit_reason.describe(...)
    exit_reason: ExitReason | None = None
    verdicts: Counter = field(default_factory=Counter)
    # dtype -> worst ratio of a passing case
    worst_pass_ratio: dict[str, float] = field(default_factory=dict)
    # dtype -> tensor -> worst ratio
    worst_pass_tensor: dict[str, dict[str, float]] = field(default_factory=dict)
    # every run, shrinking included, without its tensors (the check's failure groups read them)
    seen: list[RunRecord] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.found is None

    @property
    def disagreement(self) -> bool:
        """The (first) shrunk failure fails on the reference or the second implementation too."""
        return bool(self.bugs) and self.bugs[0].disagreement

    def rate_per_min(self) -> float:
        return 60.0 * self.runs / self.seconds if self.seconds > 0 else 0.0

    def end(self, reason: ExitReason, **budget: float | int | None) -> None:
        """Record how the run ended, as the reason and as its text."""
        self.exit_reason = reason
        self.stop = reason.describe(**budget)

    def set_headline(self) -> None:
        """Make the smallest shrunk failure the outcome's `found`/`shrunk`.

        Hypothesis shrinks the smallest failure first. When the shrink budget ends it, the first
        failure found may still be large. The sort is stable: ties keep the order found.
        """
        if not self.bugs:
            return
        self.bugs.sort(key=Bug.best_size)
        first = self.bugs[0]
        self.found, self.found_path = first.found, first.found_path
        self.shrunk, self.localisation = first.shrunk, first.localisation
        self.reference_verdict, self.second_verdict = first.reference_verdict, first.second_verdict
        self.shrunk_path = first.shrunk_path
