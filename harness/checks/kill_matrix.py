"""The kill matrix of `ring-harness selftest`: what selftest found per implementation (`MutantRun`,
`SelftestOutcome`, the declared-equivalent mutants) and, as lines: one row per mutant (stage, cases,
seconds to the first failure, the checks that failed, the minimal case), notes under a row, the
reference's false-alarm figures, and the JSON form."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from harness.checks.outcome import CheckOutcome
from harness.checks.summary import stage_counts
from harness.impls.adapters.reference import MUTANT_PREFIX
from harness.result import TENSORS, CaseResult

REFERENCE = "reference"

# Declared-equivalent mutants: name -> the argument why no valid case can tell it from the
# reference.
EQUIVALENT: dict[str, str] = {}


@dataclass
class SelftestOutcome:
    """Every implementation selftest ran (mutants, then the reference) and what was left behind."""

    runs: list = field(default_factory=list)  # MutantRun
    leftovers: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def mutants(self) -> list:
        return [r for r in self.runs if r.name != REFERENCE]

    @property
    def reference(self):
        return next((r for r in self.runs if r.name == REFERENCE), None)

    @property
    def killed(self) -> int:
        return sum(r.status == "killed" for r in self.mutants)

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.runs) and not self.leftovers


@dataclass
class MutantRun:
    """What selftest found for one implementation (a mutant, or the reference as the control)."""

    name: str
    status: str = "survived"  # killed | survived | pass | false-alarm
    stage: str = ""
    killed_by: list[str] = field(default_factory=list)
    verdict: str = ""
    cases: int = 0  # cases the check ran until the first failure (or in all)
    seconds: float | None = None  # from the check's start to the first failure
    total_s: float = 0.0
    racy: list[str] = field(default_factory=list)  # failures that did not reproduce
    shrunk: CaseResult | None = None
    shrink_tries: int = 0
    path: Path | None = None
    reference_verdict: str | None = None
    comm: str = ""
    note: str = ""
    log: Path | None = None
    check: CheckOutcome | None = None

    @property
    def ok(self) -> bool:
        """Killed (the reference: passed); a declared-equivalent mutant must survive instead."""
        if self.name in EQUIVALENT:
            return self.status == "survived"
        return self.status in ("killed", "pass")


def short(name: str) -> str:
    """'mutant:NAME' -> 'NAME'."""
    return name.removeprefix(MUTANT_PREFIX)


def kill_times(runs: list[MutantRun]) -> tuple[float | None, float | None, str]:
    """(median, worst seconds to the first failure over killed mutants, the slowest mutant)."""
    killed = [r for r in runs if r.status == "killed" and r.seconds is not None]
    if not killed:
        return None, None, ""
    worst = max(killed, key=lambda r: r.seconds)
    return statistics.median(r.seconds for r in killed), worst.seconds, worst.name


def worst_ratios(res: CheckOutcome) -> dict[str, dict[str, float]]:
    """dtype -> tensor -> worst error ratio over every passing case of a check (every stage's
    cases)."""
    out: dict[str, dict[str, float]] = {}
    for r in res.results + res.scale_results + res.fault_results:
        if r.passed:
            per = out.setdefault(r.case.dtype, {})
            for t in TENSORS:
                if r.worst(t) is not None:
                    per[t] = max(per.get(t, 0.0), r.worst(t))
    if res.prop is not None:
        for dt, per_t in res.prop.worst_pass_tensor.items():
            per = out.setdefault(dt, {})
            for t, x in per_t.items():
                per[t] = max(per.get(t, 0.0), x)
    return out


COLS = f"{'mutant':<27} {'verdict':<9} {'stage':<8} {'cases':>5} {'secs':>6}  {'killed by':<40}  shrunk case"


def row(r: MutantRun) -> str:
    """One line of the kill matrix."""
    by = ", ".join(r.killed_by) or "-"
    secs = f"{r.seconds:6.1f}" if r.seconds is not None else f"{r.total_s:6.1f}"
    where = "-"
    if r.shrunk is not None:
        where = f"{r.path or 'not saved'}: {r.shrunk.case.summary()}"
    status = r.status + ("*" if r.name in EQUIVALENT else "")
    return f"{short(r.name):<27} {status:<9} {r.stage or '-':<8} {r.cases:>5} {secs}  {by:<40}  {where}"


def notes(r: MutantRun) -> list[str]:
    """Indented lines under a row: races seen, comm count, the reference's verdict, problems."""
    lines = [f"    {x}" for x in r.racy]
    if r.comm:
        lines.append(f"    also caught by the {r.comm}")
    if r.note:
        lines.append(f"    {r.note}")
    if r.name in EQUIVALENT:
        lines.append(f"    declared equivalent: {EQUIVALENT[r.name]}")
        if r.status == "killed":
            lines.append(
                "    CONTRADICTION: declared equivalent but killed: the written argument is wrong"
            )
    return lines


def false_alarm_lines(r: MutantRun) -> list[str]:
    """The reference's side: cases run, failures, worst passing ratio per dtype and tensor."""
    res = r.check
    counts = ", ".join(f"{k} {n}" for k, n in stage_counts(res))
    lines = [
        f"reference (false alarms): {res.cases} cases ({counts}) in {r.total_s:.0f} s: "
        f"{'0 failures' if r.status == 'pass' else 'FAILED: ' + r.verdict + ' ' + ', '.join(r.killed_by)}"
    ]
    for dt, per in sorted(worst_ratios(res).items()):
        cells = "  ".join(f"{t} {per[t]:.3f}" for t in TENSORS if t in per)
        lines.append(
            f"    worst passing ratio (error / allowed), {dt}: max "
            f"{max(per.values()):.3f}  [{cells}]"
        )
    return lines


def run_json(r: MutantRun) -> dict:
    """Machine-readable row."""
    return {
        "name": r.name,
        "status": r.status,
        "ok": r.ok,
        "stage": r.stage,
        "killed_by": r.killed_by,
        "verdict": r.verdict,
        "cases": r.cases,
        "seconds_to_first_failure": r.seconds,
        "total_s": r.total_s,
        "racy_failures": r.racy,
        "shrunk": None if r.shrunk is None else r.shrunk.case.summary(),
        "shrink_tries": r.shrink_tries,
        "path": None if r.path is None else str(r.path),
        "reference_verdict": r.reference_verdict,
        "comm": r.comm,
        "note": r.note,
        "log": None if r.log is None else str(r.log),
        "worst_pass_ratio": worst_ratios(r.check)
        if r.check is not None and r.name == REFERENCE
        else None,
    }
