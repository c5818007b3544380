"""The battery stage: the fixed battery, probes of undeclared features, the capability matrix.

A deterministic implementation runs each battery case twice in a row: the repeat check. The
battery's cases come from harness.search.battery, adapted to the declared capabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.case import Case, make_case
from harness.checks import report
from harness.checks.capability_matrix import AS_BASE, format_matrix, matrix
from harness.checks.options import CheckOptions
from harness.checks.outcome import ProbeBase
from harness.context import Capabilities
from harness.impls.capabilities import VARIANT_WORDS, adapt, isolated_probe, unsupported
from harness.judging.verdicts import probe_acceptable
from harness.result import CaseResult, Verdict
from harness.runner import run_case
from harness.search import serving_draws
from harness.search.battery import battery_pool_size, default_battery

if TYPE_CHECKING:
    from harness.checks.check import Check

name = "battery"  # the stage's name (harness.checks.stages.Stage)


def _battery(opts: CheckOptions) -> list[Case]:
    """The default battery for `opts`, before adaptation."""
    return default_battery(
        opts.world_size,
        opts.dtype,
        impl=opts.impl,
        model_calls=opts.model_calls,
        variants=opts.variants,
    )


def _serving(opts: CheckOptions, caps: Capabilities) -> list[Case]:
    """The inference shapes' battery cases, seeded after the rest, for a ring that declares them."""
    if not opts.inference:
        return []
    return [
        make_case(world_size=opts.world_size, impl=opts.impl, seed=1001 + i, **kw)
        for i, kw in enumerate(serving_draws.battery_cases(opts.world_size, caps))
    ]


def plan(opts: CheckOptions, caps: Capabilities) -> tuple[list[Case], list[Case]]:
    """(the battery's cases adapted to the capabilities, the probe cases of undeclared features)."""
    cases = _battery(opts) + _serving(opts, caps)
    if opts.deadline is not None:
        cases = [c.replace(deadline_s=opts.deadline) for c in cases]
    found = probes(caps, cases)
    # a variant's case adapted to plain attention repeats a plain case: it is probed, not run
    cases = [adapt(caps, c) for c in cases if set(c.variants) <= caps.variants]
    return list({c.key(): c for c in cases if c is not None}.values()), found


def probes(caps: Capabilities, cases: list[Case]) -> list[Case]:
    """One probe case per undeclared feature the battery exercises.

    A probe is the first case using the feature, with the undeclared features of every other
    dimension adapted away. So the probe changes exactly one thing: the mask, the split, the heads,
    the layout, ... (impls.capabilities.isolated_probe). A feature no case isolates is not probed
    (`unprobed`).
    """
    seen, out = set(), []
    for c in cases:
        for f in unsupported(caps, c):
            probe = None if f in seen else isolated_probe(caps, c, f)
            if probe is not None:
                seen.update(unsupported(caps, probe))
                out.append(probe.replace(deadline_s=min(c.deadline_s, 30.0)))
    return out


def unprobed(caps: Capabilities, opts: CheckOptions) -> list[str]:
    """Undeclared features the battery uses that no probe isolates: 'not probed' in the matrix."""
    cases = _battery(opts)
    used = {f for c in cases for f in unsupported(caps, c)}
    probed = {f for p in probes(caps, cases) for f in unsupported(caps, p)}
    return sorted(used - probed)


def fitting(check: Check) -> tuple[list[Case], int]:
    """(the battery's cases that fit the pool, how many do not). The check's header counts both."""
    cases, _ = plan(check.opts, check.caps)
    fit = [c for c in cases if c.pool_size <= check.pool.capacity]
    return fit, len(cases) - len(fit)


def ranks(opts: CheckOptions, caps: Capabilities) -> int:
    """Ranks to run every battery case and probe without restarting."""
    cases, found = plan(opts, caps)
    return battery_pool_size(cases + found)


def repeat_check(first: CaseResult, again: CaseResult) -> None:
    """The "repeat" check: the same case run twice in a row on the same ranks.

    A deterministic implementation must give bit-identical outputs. State carried over between calls
    shows on the second call only: a gradient buffer cached and not zeroed, a stale receive buffer,
    a reused communicator. The first result then becomes `diverged`, with the shards that differed.
    """
    if first.verdict not in (Verdict.PASS, Verdict.SILENT_CORRUPTION):
        return
    if again.verdict == Verdict.HANG:
        return
    diffs = [
        f"{t}@rank{g}"
        for g, hs in sorted(first.hashes.items())
        for t, h in sorted(hs.items())
        if again.hashes.get(g, {}).get(t) != h
    ]
    if again.verdict != first.verdict and again.verdict != Verdict.PASS and not diffs:
        diffs = [f"verdict {again.verdict}"]
    first.extra["repeat"] = {"identical": not diffs, "diffs": diffs, "verdict": str(again.verdict)}
    if diffs:
        first.verdict = Verdict.DIVERGED
        more = f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else ""
        before = f"; first run: {first.detail}" if first.detail else ""
        first.detail = (
            "repeat: the same case run again on the same ranks gave different results "
            f"({', '.join(diffs[:6])}{more}; second run: {again.verdict}): state "
            f"carried over between calls{before}"
        )


def _run_cases(check: Check, cases: list[Case]) -> bool:
    """Each battery case, repeated when the implementation is deterministic. True: stop."""
    opts, outcome, out = check.opts, check.outcome, check.reporter
    out(report.header())
    for i, c in enumerate(cases, 1):
        r = run_case(c, check.pool, opts.impl, allow_import=opts.allow_import)
        again = None
        repeat = opts.repeat and check.resolved.deterministic
        if repeat and r.verdict in (Verdict.PASS, Verdict.SILENT_CORRUPTION):
            # A run that hung or raised is not repeated: nothing to compare, and a hang costs
            # its deadline.
            again = run_case(c, check.pool, opts.impl, allow_import=opts.allow_import, leak=False)
            repeat_check(r, again)
        outcome.results.append(r)
        outcome.cases += 1
        out(report.row(i, len(cases), r))
        for line in report.details(r):
            out(line)
        if not r.passed:
            check.save_failure(r, again=again)
            if check.record_failure(name, r):
                # A battery stopped at one of its cases records no wall time, as before `Check`.
                why = f"stopped at battery case {i} ({len(outcome.failures)} failing)"
                return check.stop(why, lap=False)
    return False


def _base_of(check: Check, probe: Case, feats: tuple[str, ...]) -> ProbeBase | None:
    """The declared case a probe was adapted from, as the battery ran it (else run now)."""
    base = adapt(check.caps, probe)
    if base is None or base.pool_size > check.pool.capacity:
        return None
    # a probe's deadline is shorter than its battery case's: the rest is the same case
    ran = {_undated(r.case): r for r in check.outcome.results}
    r = ran.get(_undated(base))
    if r is None:
        r = run_case(base, check.pool, check.opts.impl, allow_import=check.opts.allow_import)
    return ProbeBase(feats, r)


def _undated(c: Case) -> str:
    return c.replace(deadline_s=1.0).key()


def _run_probes(check: Check, found: list[Case]) -> None:
    """Each probe. A failing one is a finding only when its declared base case passes: one file
    per distinct finding, confirmed on fresh ranks like a failure."""
    opts, caps, out = check.opts, check.caps, check.reporter
    out(f"probing {len(found)} case(s) with features {opts.impl} does not declare:")
    for i, c in enumerate(found, 1):
        r = run_case(c, check.pool, opts.impl, allow_import=opts.allow_import)
        check.outcome.probe_results.append(r)
        feats = tuple(unsupported(caps, c))
        out(report.row(i, len(found), r) + "  [" + ", ".join(feats) + "]")
        if probe_acceptable(r):
            continue
        base = _base_of(check, c, feats)
        if base is not None:
            check.outcome.probe_bases[c.key()] = base
        if base is not None and not base.base.passed:
            out(f"        {AS_BASE}: {base.base.case.summary()} ({base.base.verdict})")
            continue
        ignored = ignored_variants(r, base.base if base is not None else None, feats)
        if ignored:
            out(f"        FINDING: {ignored}")
            check.outcome.probe_ignored.add(c.key())
        note = (
            f"undeclared feature probe: {', '.join(feats)}\n{r.verdict}: "
            f"{r.case.summary()}\n{r.detail}" + (f"\n{ignored}" if ignored else "")
        )
        check.save_failure(r, note=note, features=feats)


def ignored_variants(r: CaseResult, base: CaseResult | None, feats: tuple[str, ...]) -> str:
    """'accepted learned attention sinks and ignored them ...' when a variant's probe returned,
    bit for bit, what the ring returns without the variant: the same inputs, plain attention.
    '' otherwise (a value head dim changes v itself, so it is never "ignored")."""
    names = [f.partition(":")[2] for f in feats if f.startswith("variant:")]
    names = [n for n in names if n != "head_dim_v"]
    if not names or base is None or not base.passed or not r.hashes:
        return ""
    same = all(
        r.hashes.get(g, {}).get("out") == base.hashes.get(g, {}).get("out") for g in r.hashes
    )
    if not same:
        return ""
    words = " and ".join(VARIANT_WORDS[n] for n in names)
    return (
        f"accepted {words} and ignored them: every rank's out is bit for bit the ring's out "
        "without them (plain attention)"
    )


def run(check: Check) -> bool:
    """Run the battery, the probes and the capability matrix. True: stop at a battery failure."""
    _, found = plan(check.opts, check.caps)
    if _run_cases(check, fitting(check)[0]):
        return True
    if found:
        _run_probes(check, found)
    outcome = check.outcome
    left = unprobed(check.caps, check.opts)
    as_base = {k for k, b in outcome.probe_bases.items() if not b.base.passed}
    rows = matrix(
        check.caps, outcome.results, outcome.probe_results, left, as_base, outcome.probe_ignored
    )
    for line in format_matrix(rows):
        check.reporter(line)
    return False
