"""Figure 7: what the scale stage costs the default check (issue #29).

The default check of the same implementation in one run, each on fresh ranks: before (`--no-scale`:
no scale stage, property-based cases at toy sizes, as the check was before the stage) and now (the
scale stage, property-based sizes at scale). The reference runs before, now, now, before (so a drift
of the host's load weighs on both sides alike); the target is the ratio of the sums, now / before
(<= 1.5). A narrow ring (torch-ring: two layouts, two masks) runs once each: what an implementation
that declares less pays. `quick` (CI's smoke test) runs only the battery and the scale stage of the
reference on one pool: the scale stage's wall time against the battery's.
"""

from __future__ import annotations

import io
import time

from harness.bench.timing import Figure, Target, fmt, load_line
from harness.checks.check import check
from harness.checks.options import CheckOptions
from harness.checks.report import Reporter

NARROW = "torch-ring"
STAGES = ("ranks start", "growth", "battery", "scale", "faults", "property")


def _timed(opts: CheckOptions) -> tuple[float, dict[str, float], bool, str]:
    """(wall seconds, seconds per stage, passed, its last line) of one default check, its report
    discarded."""
    from harness.checks.summary import verdict_line

    t0 = time.perf_counter()
    res = check(opts, Reporter(io.StringIO()))
    return time.perf_counter() - t0, dict(res.stage_seconds), res.passed, verdict_line(res)


def _quick(save_dir: str) -> Figure:
    from harness.checks.check import run_check
    from harness.ranks.pool import RankPool

    fig = Figure("check_cost", "quick: the reference's battery and scale stage on one pool")
    opts = CheckOptions(save_dir=save_dir, max_examples=0, growth=False, fault_stage=())
    with RankPool(8) as pool:
        res = run_check(pool, opts, reporter=Reporter(io.StringIO()))
    battery, scale = res.stage_seconds["battery"], res.stage_seconds["scale"]
    fig.lines.append(
        f"battery {fmt(battery)} s ({len(res.results)} cases, each run twice), scale "
        f"stage {fmt(scale)} s "
        f"({len(res.scale_results)} cases); passed: {res.passed}"
    )
    fig.lines.append(load_line())
    fig.targets = [Target("scale stage / battery wall time", scale / battery, "<=", 1.0)]
    fig.data = {"stage_seconds": res.stage_seconds, "passed": res.passed}
    return fig


def run(quick: bool = False, save_dir: str | None = None) -> Figure:
    import tempfile

    if quick:
        with tempfile.TemporaryDirectory(prefix="rh-bench-") as tmp:
            return _quick(save_dir or tmp)
    order = [
        ("reference", "before"),
        ("reference", "now"),
        ("reference", "now"),
        ("reference", "before"),
        (NARROW, "before"),
        (NARROW, "now"),
    ]
    fig = Figure(
        "check_cost",
        "the default check before (--no-scale) and now, side by side, fresh ranks each",
    )
    fig.lines.append(
        "impl        check   wall s  " + "  ".join(f"{s:>11}" for s in STAGES) + "  passed"
    )
    rows: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="rh-bench-") as tmp:
        for i, (impl, label) in enumerate(order):
            opts = CheckOptions(impl=impl, scale=label == "now", save_dir=save_dir or tmp)
            wall, stages, passed, last = _timed(opts)
            rows[impl, label] = rows.get((impl, label), 0.0) + wall
            fig.lines.append(
                f"{impl:<11} {label:<7} {wall:7.1f}  "
                + "  ".join(f"{stages.get(s, 0.0):11.1f}" for s in STAGES)
                + f"  {passed}"
            )
            if not passed:
                fig.lines.append(f"    {last}")
            fig.data[f"{i}:{impl}/{label}"] = {"wall_s": wall, "stages": stages, "passed": passed}
    for impl in ("reference", NARROW):
        fig.lines.append(f"{impl}: now / before = {fmt(rows[impl, 'now'] / rows[impl, 'before'])}")
    fig.lines.append(load_line())
    fig.targets = [
        Target(
            "reference check now / before (scale stage + sizes at scale)",
            rows["reference", "now"] / rows["reference", "before"],
            "<=",
            1.5,
        )
    ]
    return fig
