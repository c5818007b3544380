"""The capability matrix `check` prints: per feature, declared or not, how many battery cases used
it and passed or failed, and what a probe of an undeclared feature really did (`PROBE_OUTCOMES`, or
`AS_BASE` when the declared case it was adapted from fails too)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from harness.context import Capabilities
from harness.impls.capabilities import case_features, unsupported
from harness.judging.verdicts import PROBE_OUTCOMES

# a failing probe whose declared base case fails too: the base's failure, no finding
AS_BASE = "fails as its declared case does"
# a variant's probe that returned plain attention, bit for bit (stages.battery.ignored_variants)
IGNORED = "FINDING: accepted it and returned plain attention"


@dataclass
class MatrixRow:
    """One row of the capability matrix: a feature, whether it is declared, and how runs using it
    went."""

    feature: str
    declared: bool
    passed: int = 0
    failed: int = 0
    probes: dict[str, int] = field(default_factory=dict)  # verdict -> count, for undeclared probes


def matrix(
    caps: Capabilities,
    results: list,
    probe_results: list,
    not_probed: list[str] = (),
    as_base: set[str] = frozenset(),
    ignored: set[str] = frozenset(),
) -> list[MatrixRow]:
    """Aggregate case results by feature; probe results are cases using exactly one undeclared
    feature; `not_probed`: undeclared features the battery uses that no case isolates; `as_base`:
    the case keys of probes whose declared base case fails too (no finding); `ignored`: those of
    variant probes that returned plain attention."""
    rows: dict[str, MatrixRow] = {}
    probed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in results:
        for f in case_features(r.case):
            row = rows.setdefault(f, MatrixRow(f, True))
            if r.passed:
                row.passed += 1
            else:
                row.failed += 1
    for r in probe_results:
        for f in unsupported(caps, r.case):
            rows.setdefault(f, MatrixRow(f, False))
            key = r.case.key()
            probed[f][AS_BASE if key in as_base else IGNORED if key in ignored else r.verdict] += 1
    for f, counts in probed.items():
        rows[f].probes = dict(counts)
    for f in not_probed:
        rows.setdefault(f, MatrixRow(f, False)).probes = {"not probed": 0}
    return [rows[k] for k in sorted(rows, key=lambda k: (k.split(":")[0], k))]


def format_matrix(rows: list[MatrixRow]) -> list[str]:
    """The matrix as text lines, one per feature, with a header."""
    w = max([20, *(len(row.feature) for row in rows)])
    lines = [
        f"{'feature':<{w}} {'declared':<9} {'passed':>6} {'failed':>6}  probe of an undeclared feature"
    ]
    for row in rows:
        probe = ", ".join(
            f"{n} x {PROBE_OUTCOMES.get(v, v)}" for v, n in sorted(row.probes.items())
        )
        if "not probed" in row.probes:
            probe = "not probed: no battery case changes this feature alone"
        lines.append(
            f"{row.feature:<{w}} {'yes' if row.declared else 'no':<9} {row.passed:>6} {row.failed:>6}  "
            f"{probe or '-'}"
        )
    return lines
