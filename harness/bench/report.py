"""Figure 8: a wrong ring's report: one group per bug, its cause in words, the whole check (issue #42).

The default check of four mutants, each wrong for one value of one feature, each on fresh ranks:
at world sizes that are not powers of two, a crash on uneven splits at W >= 3, past a kernel tile,
and on the last rank only. Per mutant it prints the wall time, the failure groups, the saved files
and the shared-feature line. The targets: every mutant one group whose line names a condition,
and the slowest whole check under 60 s. `quick` (CI's smoke test) runs one mutant's battery and
fault stage only.
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path

from harness.bench.timing import Figure, Target, fmt, load_line
from harness.checks.check import check
from harness.checks.options import CheckOptions
from harness.checks.report import Reporter

MUTANTS = (
    "steps-rounded-to-power-of-two",
    "uneven-split-crash-from-three",
    "tile-tail-dropped",
    "last-rank-own-block-unmasked",
)
LIMIT_S = 60.0


def _one(name: str, save_dir: Path, quick: bool) -> dict:
    """One mutant's whole check: wall s, groups, saved files, the first group's line."""
    opts = CheckOptions(impl=f"mutant:{name}", save_dir=str(save_dir))
    if quick:
        opts = CheckOptions(
            impl=f"mutant:{name}", save_dir=str(save_dir), max_examples=0, scale=False, growth=False
        )
    t0 = time.perf_counter()
    res = check(opts, Reporter(io.StringIO()))
    wall = time.perf_counter() - t0
    lines = [g.shared.line() for g in res.groups if g.shared is not None]
    return {
        "wall_s": wall,
        "groups": len(res.groups),
        "files": len(list(save_dir.glob("*.yaml"))),
        "line": lines[0] if lines else "",
        "named": bool(res.groups) and all(g.shared and g.shared.conditions for g in res.groups),
        "passed": res.passed,
    }


def run(quick: bool = False) -> Figure:
    names = MUTANTS[:1] if quick else MUTANTS
    fig = Figure("report", "a wrong ring's whole check: groups, saved files, the shared line")
    fig.lines.append("mutant                          wall s  groups  files")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rh-bench-") as tmp:
        for name in names:
            row = rows[name] = _one(name, Path(tmp) / name, quick)
            fig.lines.append(
                f"{name:<31} {row['wall_s']:6.1f}  {row['groups']:6d}  {row['files']:5d}"
            )
            fig.lines.append(f"    {row['line']}")
    fig.lines.append(load_line())
    fig.data = rows
    one = sum(r["groups"] == 1 and r["named"] for r in rows.values())
    slowest = max(r["wall_s"] for r in rows.values())
    fig.targets = [
        Target("mutants reported as one group with a named cause", one, ">=", len(names)),
    ]
    if not quick:
        fig.targets.append(
            Target("slowest whole check of a wrong ring", slowest, "<=", LIMIT_S, " s")
        )
    fig.lines.append(f"slowest: {fmt(slowest)} s")
    return fig
