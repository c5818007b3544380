"""What one default check ran and found: its failures, its per-stage results and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.judging.run_record import RunRecord
from harness.judging.verdicts import fault_ok, probe_acceptable
from harness.result import CaseResult

if TYPE_CHECKING:
    from harness.checks.stages.growth import GrowthCase, GrowthOutcome
    from harness.search.outcome import FuzzOutcome


class ExitReason(enum.Enum):
    """How a check ended. `CheckOutcome.stopped` says the same in words."""

    FINISHED = "finished"  # every stage ran
    FIRST_FAILURE = "first-failure"  # stopped at the first accepted failure (selftest)
    MAXFAIL = "maxfail"  # --maxfail failures were recorded
    MAX_HANGS = "max-hangs"  # --max-hangs failing cases hung
    INTERRUPTED = "interrupted"  # a signal or Ctrl-C


@dataclass
class Failure:
    """One failing case of a check: its stage, how many cases had run, how long it took to find."""

    stage: str  # "growth", "battery", "scale", "faults", "property" or "shape"
    cases: int  # cases run by the check up to and including this one
    seconds: float  # since the check started
    result: CaseResult
    accepted: bool = True
    shrunk: CaseResult | None = None  # the property-based run's minimal failure
    # a growth-check failure: its figures (`result` is its worst W)
    growth: GrowthCase | None = None


@dataclass
class ProbeBase:
    """A probe of undeclared features and its declared base: the case it was adapted from.

    A probe that fails is a finding only when its base passes. `group`: the failure group of a
    failing base, numbered from 1 as the report lists them.
    """

    features: tuple[str, ...]
    base: CaseResult
    group: int | None = None

    def to_json(self) -> dict:
        return {
            "features": list(self.features),
            "case": self.base.case.summary(),
            "key": self.base.case.key(),
            "verdict": str(self.base.verdict),
            "group": self.group,
        }


@dataclass
class CheckOutcome:
    """Everything one check ran and found."""

    impl: str
    results: list[CaseResult] = field(default_factory=list)  # the fixed battery
    scale_results: list[CaseResult] = field(default_factory=list)  # the scale stage
    # --shape: the basics at the user's shape
    shape_results: list[CaseResult] = field(default_factory=list)
    shape: str = ""  # --shape: the shape, as b1,hq32,hkv8,d128,L8192,W8
    probe_results: list[CaseResult] = field(default_factory=list)
    fault_results: list[CaseResult] = field(default_factory=list)
    growth: GrowthOutcome | None = None
    prop: FuzzOutcome | None = None
    failures: list[Failure] = field(default_factory=list)
    cases: int = 0
    seconds: float = 0.0
    stopped: str = ""  # why the check ended before its last stage, if it did
    exit_reason: ExitReason | None = None  # how the check ended; None while it runs
    # failure signature -> [saved path, failing cases]
    distinct: dict = field(default_factory=dict)
    # a torchrun rank other than 0: it ran cases, rank 0 judged and reports
    follower: bool = False
    # failure signature -> its fresh-rank confirmation (HistoryFinding)
    histories: dict = field(default_factory=dict)
    hangs: int = 0  # failing cases that hung (the check stops at CheckOptions.max_hangs)
    # probe finding signature -> [saved path, findings]
    finding_files: dict = field(default_factory=dict)
    # stage -> its wall time (growth, battery, scale, faults, ...)
    stage_seconds: dict = field(default_factory=dict)
    # the signal that stopped the check (SIGINT, SIGTERM), if one did
    interrupted: str | None = None
    # fault-stage failures re-run without their faults (harness.checks.groups)
    clean_reruns: list[RunRecord] = field(default_factory=list)
    # failure signatures that did not reproduce bit for bit on fresh ranks, nor in a sequence
    racy: set = field(default_factory=set)
    # failure signatures that reproduce only after a sequence of earlier cases
    history: set = field(default_factory=set)
    # the failure groups, built when the check ends (harness.checks.groups.FailureGroup)
    groups: list = field(default_factory=list)
    # a failing probe's case key -> its declared base case and how that ended
    probe_bases: dict[str, ProbeBase] = field(default_factory=dict)
    # case keys of variant probes that returned plain attention (stages.battery.ignored_variants)
    probe_ignored: set[str] = field(default_factory=set)
    # what the failure groups' experiments and headline shrinking ran (harness.checks.experiments)
    lab_runs: list[RunRecord] = field(default_factory=list)

    @property
    def findings(self) -> list[CaseResult]:
        """Probes of undeclared features that did not end in pass or a clean error, while their
        declared base case passed (or was not run)."""
        return [r for r in self.probe_results if not probe_acceptable(r) and self.base_passed(r)]

    def base_passed(self, probe: CaseResult) -> bool:
        """Whether a probe's declared base case passed. True when none was run."""
        found = self.probe_bases.get(probe.case.key())
        return found is None or found.base.passed

    @property
    def passed(self) -> bool:
        if self.follower:
            return True
        if self.interrupted:
            return False
        cases = self.results + self.scale_results + self.shape_results
        return (
            all(r.passed for r in cases)
            and all(fault_ok(r) for r in self.fault_results)
            and (self.growth is None or self.growth.passed)
            and (self.prop is None or self.prop.passed)
            and not self.findings
        )

    def kill(self) -> Failure | None:
        """The first accepted failure."""
        return next((f for f in self.failures if f.accepted), None)
