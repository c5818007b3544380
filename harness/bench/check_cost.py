"""Figure 7: what the scale stage costs the default check (issue #29).

The default check of the same implementation, twice in one run, each on fresh ranks: before (`--no-scale`:
no scale stage, property-based cases at toy sizes, as the check was before the stage) and now (the scale
stage, property-based sizes at scale). Wall time per stage and in all; the target is the ratio now / before
on the reference (<= 1.5). A narrow ring (torch-ring: two layouts, two masks) shows what an implementation
that declares less pays. `quick` (CI's smoke test) runs only the battery and the scale stage of the reference on
one pool: the scale stage's wall time against the battery's.
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


def _timed(opts: CheckOptions) -> tuple[float, dict[str, float], bool]:
    """(wall seconds, seconds per stage, passed) of one default check, its report discarded."""
    t0 = time.perf_counter()
    res = check(opts, Reporter(io.StringIO()))
    return time.perf_counter() - t0, dict(res.stage_seconds), res.passed


def _quick(save_dir: str) -> Figure:
    from harness.checks.check import run_check
    from harness.ranks.pool import RankPool

    fig = Figure("check_cost", "quick: the reference's battery and scale stage on one pool")
    opts = CheckOptions(save_dir=save_dir, max_examples=0, growth=False, fault_stage=())
    with RankPool(8) as pool:
        res = run_check(pool, opts, reporter=Reporter(io.StringIO()))
    battery, scale = res.stage_seconds["battery"], res.stage_seconds["scale"]
    fig.lines.append(f"battery {fmt(battery)} s ({len(res.results)} cases, each run twice), scale stage {fmt(scale)} s "
                     f"({len(res.scale_results)} cases); passed: {res.passed}")
    fig.lines.append(load_line())
    fig.targets = [Target("scale stage / battery wall time", scale / battery, "<=", 1.0)]
    fig.data = {"stage_seconds": res.stage_seconds, "passed": res.passed}
    return fig


def run(quick: bool = False, save_dir: str | None = None) -> Figure:
    import tempfile

    if quick:
        with tempfile.TemporaryDirectory(prefix="rh-bench-") as tmp:
            return _quick(save_dir or tmp)
    impls = ["reference", NARROW]
    fig = Figure("check_cost", "the default check before (--no-scale) and now, side by side, fresh ranks each")
    fig.lines.append("impl        check   wall s  " + "  ".join(f"{s:>11}" for s in STAGES) + "  passed")
    rows: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="rh-bench-") as tmp:
        for impl in impls:
            for label, scale in (("before", False), ("now", True)):
                opts = CheckOptions(impl=impl, scale=scale, save_dir=save_dir or tmp)
                wall, stages, passed = _timed(opts)
                rows[impl, label] = wall
                fig.lines.append(f"{impl:<11} {label:<7} {wall:7.1f}  "
                                 + "  ".join(f"{stages.get(s, 0.0):11.1f}" for s in STAGES) + f"  {passed}")
                fig.data[f"{impl}/{label}"] = {"wall_s": wall, "stages": stages, "passed": passed}
    for impl in impls:
        fig.lines.append(f"{impl}: now / before = {fmt(rows[impl, 'now'] / rows[impl, 'before'])}")
    fig.lines.append(load_line())
    fig.targets = [Target("reference check now / before (scale stage + sizes at scale)",
                          rows["reference", "now"] / rows["reference", "before"], "<=", 1.5)]
    return fig
