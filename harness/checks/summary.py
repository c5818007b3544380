"""The summary of a check: its JSON, its counts by stage, failure groups and verdict line."""

from __future__ import annotations

from harness.checks.outcome import CheckOutcome
from harness.checks.stages.property import property_json
from harness.interrupt import EXIT_CODES
from harness.judging.verdicts import fault_ok
from harness.result import CaseResult


def outcome_json(res: CheckOutcome) -> dict:
    """Machine-readable results of a check (for --json)."""
    return {
        "impl": res.impl,
        "seconds": res.seconds,
        "passed": res.passed,
        "stopped": res.stopped,
        "results": [r.to_dict() for r in res.results],
        "scale": [r.to_dict() for r in res.scale_results],
        "shape": [r.to_dict() for r in res.shape_results],
        "stage_seconds": dict(res.stage_seconds),
        "cases_by_stage": dict(stage_counts(res)),
        "distinct_failures": 0 if res.passed else distinct_failures(res),
        "failure_groups": [g.to_json() for g in res.groups],
        "probes": [_probe_json(res, r) for r in res.probe_results],
        "faults": [r.to_dict() for r in res.fault_results],
        "growth": None if res.growth is None else res.growth.to_dict(),
        "property": None if res.prop is None else property_json(res.prop),
        "first_failure": first_failure_json(res),
    }


def _probe_json(res: CheckOutcome, r: CaseResult) -> dict:
    """A probe's result, with its declared base case when it failed, and whether it is a finding."""
    base = res.probe_bases.get(r.case.key())
    extra = {
        "base": None if base is None else base.to_json(),
        "finding": any(x is r for x in res.findings),
    }
    return {**r.to_dict(), **extra}


def first_failure_json(res: CheckOutcome) -> dict | None:
    """The check's first failing case: its stage, count and time. None when nothing failed."""
    if not res.failures:
        return None
    f = min(res.failures, key=lambda x: x.seconds)
    r = f.result
    return {
        "stage": f.stage,
        "cases": f.cases,
        "seconds": round(f.seconds, 1),
        "verdict": r.verdict,
        "case": r.case.summary(),
    }


def stage_counts(res: CheckOutcome) -> list[tuple[str, int]]:
    """What ran, by stage, in run order: (stage, cases).

    The one count the summary, the verdict line and the JSON use. A growth-check case is one run at
    one ring size. A property-based case is one generated example.
    """
    g = res.growth
    rows = [
        ("growth check", sum(len(c.results) for c in g.cases) if g else 0),
        ("battery", len(res.results)),
        ("probes", len(res.probe_results)),
        ("scale", len(res.scale_results)),
        ("at your shape", len(res.shape_results)),
        ("fault stage", len(res.fault_results)),
        ("property-based", res.prop.examples if res.prop else 0),
        ("experiments", len(res.lab_runs)),
    ]
    return [(k, n) for k, n in rows if n]


def counts_line(res: CheckOutcome) -> str:
    """'386 cases in 84 s: growth check 16, battery 54, scale 7, fault stage 9, property-based
    300'."""
    rows = stage_counts(res)
    return f"{sum(n for _, n in rows)} cases in {res.seconds:.0f} s: " + (
        ", ".join(f"{k} {n}" for k, n in rows) or "none"
    )


def distinct_failures(res: CheckOutcome) -> int:
    """Failure groups: one per bug (harness.checks.groups), as the report lists them."""
    return len(res.groups)


def _passed_line(res: CheckOutcome) -> str:
    """The verdict line of a check that passed, with the growth check's worst figure."""
    g = res.growth
    worst = None
    if g:
        worst = max((c.worst for c in g.cases if c.worst), key=lambda x: x[2], default=None)
    grew = ""
    if worst:
        grew = f"; the growth check's worst x{worst[2]:.2f} ({worst[1]} at W{worst[0]})"
    where = f" at shape {res.shape}" if res.shape else ""
    return (
        f"check PASSED (exit 0): every case of {res.impl}{where} passed ({counts_line(res)}{grew})"
    )


def _failed_stages(res: CheckOutcome) -> list[str]:
    """What failed, stage by stage: '<stage> <failing>/<run> cases' and the like."""
    stages = []
    bad_battery = sum(not r.passed for r in res.results)
    bad_scale = sum(not r.passed for r in res.scale_results)
    bad_shape = sum(not r.passed for r in res.shape_results)
    if bad_shape:
        stages.append(f"at your shape {bad_shape}/{len(res.shape_results)} basics")
    bad_faults = sum(not fault_ok(r) for r in res.fault_results)
    if bad_battery:
        stages.append(f"battery {bad_battery}/{len(res.results)} cases")
    if bad_scale:
        stages.append(f"scale stage {bad_scale}/{len(res.scale_results)} cases")
    if bad_faults:
        stages.append(f"fault stage {bad_faults}/{len(res.fault_results)} cases")
    if res.growth is not None and not res.growth.passed:
        gc = res.growth.failures[0]
        n, total = len(res.growth.failures), len(res.growth.cases)
        stages.append(f"growth check {n}/{total} global cases ({gc.detail})")
    if res.prop is not None and not res.prop.passed:
        shown = res.prop.shrunk or res.prop.found
        stages.append(f"property-based ({shown.verdict}: {shown.case.summary()})")
    if res.findings:
        stages.append(f"{len(res.findings)} undeclared-feature finding(s)")
    return stages


def verdict_line(res: CheckOutcome) -> str:
    """The last line of a check.

    It says what the exit status means, which stage failed and how many failure groups there
    are (one saved file each).
    """
    if res.interrupted:
        code = EXIT_CODES.get(res.interrupted, 1)
        return (
            f"check INTERRUPTED by {res.interrupted} (exit {code}): stopped after "
            f"{res.cases} cases; nothing more was run"
        )
    if res.passed:
        return _passed_line(res)
    why = f"; {res.stopped}" if res.stopped else ""
    stages = "; ".join(_failed_stages(res))
    n = distinct_failures(res)
    return f"check FAILED (exit 1): {stages}; {n} failure group(s){why}"
