"""The default `check` pipeline as one function, shared by `ring-harness check` and `ring-harness selftest`.

Stages, in order: the growth check (harness.checks.growth: the same global case at W = 1, 2, 4, 8,
whose error must not grow with W; first because it is cheap, ~16 small runs, and a per-step precision
loss passes every single case, so after the battery it was found only after ~100 runs), the fixed
battery (then probes of undeclared features and the capability matrix), the scale stage (seven cases
at training sizes: harness.search.scale), the buffer-discipline fault stage, and the property-based run.
`stop_at_first_failure` ends the check at the first failing case that `accept` takes (selftest accepts only
failures that reproduce bit for bit); a failure it refuses is recorded and the check goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.case import Case, make_case
from harness.checks import growth as growth_stage
from harness.checks import property as prop_stage
from harness.checks import report
from harness.checks.capability_matrix import format_matrix, matrix
from harness.checks.options import FAULT_STAGE_DEFAULT, FAULT_STAGE_KINDS, CheckOptions, parse_kinds
from harness.checks.report import Reporter
from harness.context import Capabilities
from harness.diagnose import localise
from harness.errors import HarnessError, Interrupted
from harness.faults.schema import make_fault
from harness.impls import registry
from harness.impls.capabilities import adapt, isolated_probe, unsupported
from harness.judging.verdicts import adapter_error, failure_signature, fault_ok, probe_acceptable
from harness.result import CaseResult, Verdict, failure_path, save_result
from harness.runner import oracle_mode, run_case
from harness.search import history
from harness.search.battery import battery_pool_size, default_battery
from harness.search.fuzz import FuzzOutcome
from harness.search.scale import scale_cases
from ring_impl.masks import MaskSpec

# (world size, tokens, layout, mask) of the fault stage: W = 2 for the dk/dv ring, W >= 3 for a forward
# K/V slot that is received into while it is still being sent.
FAULT_STAGE_SHAPES = (
    (2, 9, "contiguous", MaskSpec("none")),
    (3, 14, "zigzag", MaskSpec("causal")),
    (4, 21, "striped", MaskSpec("window", window=3)),
)


@dataclass
class Failure:
    """One failing case of a check: its stage, how many cases had run and how long it took to find it."""

    stage: str  # "growth", "battery", "scale", "faults", "property" or "shape"
    cases: int  # cases run by the check up to and including this one
    seconds: float  # since the check started
    result: CaseResult
    accepted: bool = True
    shrunk: CaseResult | None = None  # the property-based run's minimal failure
    growth: growth_stage.GrowthCase | None = None  # a growth-check failure: its figures (`result` is its worst W)


@dataclass
class CheckOutcome:
    """Everything one check ran and found."""

    impl: str
    results: list[CaseResult] = field(default_factory=list)  # the fixed battery
    scale_results: list[CaseResult] = field(default_factory=list)  # the scale stage
    shape_results: list[CaseResult] = field(default_factory=list)  # --shape: the basics at the user's shape
    shape: str = ""  # --shape: the shape, as b1,hq32,hkv8,d128,L8192,W8
    probe_results: list[CaseResult] = field(default_factory=list)
    fault_results: list[CaseResult] = field(default_factory=list)
    growth: growth_stage.GrowthOutcome | None = None
    prop: FuzzOutcome | None = None
    failures: list[Failure] = field(default_factory=list)
    cases: int = 0
    seconds: float = 0.0
    stopped: str = ""  # why the check ended before its last stage, if it did
    distinct: dict = field(default_factory=dict)  # failure signature -> [saved path, failing cases]
    follower: bool = False  # a torchrun rank other than 0: it ran cases, rank 0 judged and reports
    histories: dict = field(default_factory=dict)  # failure signature -> its fresh-rank confirmation (HistoryFinding)
    hangs: int = 0  # failing cases that hung (the check stops at CheckOptions.max_hangs)
    finding_files: dict = field(default_factory=dict)  # probe finding signature -> [saved path, findings]
    stage_seconds: dict = field(default_factory=dict)  # stage -> its wall time (growth, battery, scale, faults, ...)
    interrupted: str | None = None  # the signal that stopped the check (SIGINT, SIGTERM), if one did

    @property
    def findings(self) -> list[CaseResult]:
        """Probes of undeclared features that did not end in pass or a clean error."""
        return [r for r in self.probe_results if not probe_acceptable(r)]

    @property
    def passed(self) -> bool:
        if self.follower:
            return True
        if self.interrupted:
            return False
        return (all(r.passed for r in self.results + self.scale_results + self.shape_results)
                and all(fault_ok(r) for r in self.fault_results)
                and (self.growth is None or self.growth.passed)
                and (self.prop is None or self.prop.passed) and not self.findings)

    def kill(self) -> Failure | None:
        """The first accepted failure."""
        return next((f for f in self.failures if f.accepted), None)


def _stage_fault(kind: str, world: int) -> dict:
    """`kind` on every rank and every op of both phases (a straggler needs one rank: the last)."""
    return make_fault(kind, rank=world - 1) if kind == "straggler" else make_fault(kind)


def fault_stage_cases(kinds: tuple[str, ...], impl: str, caps: Capabilities, *, max_world: int,
                      deadline_s: float, dtype: str | None = None) -> list[Case]:
    """Per shape, one case per kind and one with all kinds at once, each fault on every rank and op
    of both phases. A bug then shows deterministically: a read before its wait sees NaN, an
    overwrite of a buffer being sent is caught when it happens; with early-read and send-reuse
    together every byte moves at a point fixed by the program order, so even a racy
    implementation's wrong numbers are the same on every run (replayable bit for bit)."""
    out = []
    for w, total, layout, mask in FAULT_STAGE_SHAPES:
        if w > max_world:
            continue
        for group in [(k,) for k in kinds] + ([kinds] if len(kinds) > 1 else []):
            c = make_case(world_size=w, total_len=total, layout=layout, mask=mask, heads_q=4, heads_kv=2,
                          head_dim=8, seed=100 + len(out), impl=impl, dtype=dtype or "fp32",
                          deadline_s=deadline_s, faults=tuple(_stage_fault(k, w) for k in group))
            c = adapt(caps, c)
            if c is not None:
                out.append(c)
    return out


def battery_plan(opts: CheckOptions, caps: Capabilities) -> tuple[list[Case], list[Case]]:
    """(battery cases adapted to the capabilities, probe cases of undeclared features)."""
    cases = default_battery(opts.world_size, opts.dtype, impl=opts.impl, model_calls=opts.model_calls)
    if opts.deadline is not None:
        cases = [c.replace(deadline_s=opts.deadline) for c in cases]
    probes = _probes(caps, cases)
    cases = [adapt(caps, c) for c in cases]
    return list({c.key(): c for c in cases if c is not None}.values()), probes


def _probes(caps: Capabilities, cases: list[Case]) -> list[Case]:
    """One probe case per undeclared feature the battery exercises: the first case using it, with the undeclared
    features of every other dimension adapted away, so the probe changes exactly one thing (the mask, the split,
    the heads, the layout, ...; impls.capabilities.isolated_probe); a feature no case isolates is not probed
    (`unprobed`)."""
    seen, out = set(), []
    for c in cases:
        for f in unsupported(caps, c):
            probe = None if f in seen else isolated_probe(caps, c, f)
            if probe is not None:
                seen.update(unsupported(caps, probe))
                out.append(probe.replace(deadline_s=min(c.deadline_s, 30.0)))
    return out


def unprobed(caps: Capabilities, opts: CheckOptions) -> list[str]:
    """Undeclared features the battery exercises that no probe isolates (the matrix says 'not probed')."""
    cases = default_battery(opts.world_size, opts.dtype, impl=opts.impl, model_calls=opts.model_calls)
    used = {f for c in cases for f in unsupported(caps, c)}
    probed = {f for p in _probes(caps, cases) for f in unsupported(caps, p)}
    return sorted(used - probed)


def run_check(pool, opts: CheckOptions, *, stop_at_first_failure: bool = False,
              accept: Callable[[CaseResult], bool] | None = None, reporter: Reporter | None = None,
              outcome: CheckOutcome | None = None) -> CheckOutcome:
    """Run the default check of `opts.impl` on `pool` (see the module docstring); failing cases are
    saved under opts.save_dir as they happen. Results go into `outcome` as they come (so a caller
    interrupted mid-check still holds what finished)."""
    out = reporter or report.out
    impl, allow_import = opts.impl, opts.allow_import
    caps = registry.resolve(impl, allow_import=allow_import).capabilities
    cases, probes = battery_plan(opts, caps)
    res = outcome if outcome is not None else CheckOutcome(impl=impl)
    start, paused = time.perf_counter(), [0.0]

    def elapsed() -> float:
        """The check's own time: without the time `accept` spends re-running failures."""
        return time.perf_counter() - start - paused[0]

    def failed(stage: str, r: CaseResult, minimal: CaseResult | None = None,
               grown: growth_stage.GrowthCase | None = None) -> bool:
        """Record a failure (`accept` judges the minimal one when there is one); True: stop here."""
        seconds, t0 = elapsed(), time.perf_counter()
        ok = accept is None or accept(minimal or r)
        paused[0] += time.perf_counter() - t0
        res.failures.append(Failure(stage, res.cases, seconds, r, ok, minimal, grown))
        if not ok:
            out("        not accepted as this check's failure (it did not reproduce); going on")
        if opts.maxfail is not None and len(res.failures) >= opts.maxfail:
            return True
        if r.verdict == Verdict.HANG:
            res.hangs += 1
            if opts.max_hangs and res.hangs >= opts.max_hangs:
                return True
        return stop_at_first_failure and ok

    def save(r: CaseResult, note: str | None = None, again: CaseResult | None = None,
             features: tuple[str, ...] = ()) -> None:
        """One saved file per distinct failure (its first case), confirmed on fresh ranks first; one that
        does not reproduce there is history-dependent and saved as the sequence of cases that does
        (harness.search.history). `again`: the repeat check's second run of the case. `features`: the
        undeclared features of a probe: its finding is grouped with its features, in res.finding_files."""
        sig = (*sorted(features), *failure_signature(r))
        table, what = (res.finding_files, "finding") if features else (res.distinct, "failure")
        if sig in table:
            table[sig][1] += 1
            out(f"        same {what} as {table[sig][0]} ({' '.join(sig)}): not saved again")
            return
        t0 = time.perf_counter()
        repeat = again is not None and r.extra.get("repeat", {}).get("identical") is False
        if repeat and again.passed:  # differs only in bits, passes on its own: no failing run to reproduce
            path = save_result(r, opts.save_dir, backend=pool.backend, note="\n".join(filter(None, [
                note, f"{r.verdict}: {r.case.summary()}", r.detail, "history-dependent: the second run differs in "
                "bits but passes on its own; replaying this case alone does not reproduce the divergence"])))
            table[sig] = [path, 1]
            out(f"        saved {path} (history-dependent: NOT a reproducer on its own)")
            return
        target = again if repeat else r  # the repeat check's failing run is the second one
        found = history.confirm(pool, target, impl, leak=not repeat, allow_import=allow_import)
        res.histories[sig] = found
        for line in found.lines():
            out(line)
        if found.sequence is not None:
            stem = failure_path(opts.save_dir, found.reproducer).stem + "-sequence"
            path = history.save_sequence(found, failure_path(opts.save_dir, found.reproducer, stem),
                                         backend=pool.backend, note=note or "")
        else:
            rec = found.reproducer  # the fresh run when it confirmed the failure
            loc = localise.localise(rec, pool)  # where the errors are, as a property-based failure's
            for line in localise.lines(loc):
                out(line)
            text = note or f"{rec.verdict}: {rec.case.summary()}\n{rec.detail}"
            text += f"\n{found.evidence()}" + (f"; NOT A REPRODUCER: {found.note}" if found.history_dependent else "")
            text += "".join(f"\nwhere: {f}" for f in loc.findings)
            path = save_result(rec, opts.save_dir, backend=pool.backend, note=text,
                               extra={"localisation": localise.summary(loc), "signature": " ".join(sig)})
        paused[0] += time.perf_counter() - t0  # the confirmation is not the check's own time
        table[sig] = [path, 1]
        out(f"        {'finding ' if features else ''}saved {path}")

    def finish(why: str = "") -> CheckOutcome:
        if why and opts.max_hangs and res.hangs >= opts.max_hangs:
            why += (f": {res.hangs} hanging case(s), each waited out its deadline (--max-hangs {opts.max_hangs}; "
                    "0 runs every case)")
        res.stopped, res.seconds = why, time.perf_counter() - start
        return res

    resolved = registry.resolve(impl, allow_import=allow_import)
    if not resolved.declared:
        out(f"note: {impl} is a bare function, so it declares every feature (every layout, mask and dtype, GQA, "
            "uneven splits, W 1-8, subgroups) and every case runs as supported; to declare what it supports, "
            "wrap it: harness.Impl(name, run, capabilities=harness.Capabilities(...)) (README: 'Validating your "
            "own implementation')")
    pre = preflight(pool, opts, caps)
    if pre is not None and pre.verdict == Verdict.HANG:  # it cost its deadline: it counts toward --max-hangs
        res.hangs += 1
        out(f"preflight case hung: {pre.detail[:200]}")
    if opts.shape is not None:
        out(f"ring-harness check --shape: impl {impl}, {pool.backend} ranks ({opts.launcher}, {pool.size} ranks"
            f"{placement_text(pool)})")
        _shape_run(pool, opts, caps, res, out, failed, save)
        return finish()
    too_big = [c for c in cases if c.pool_size > pool.size]
    if too_big:
        out(f"skipping {len(too_big)} case(s) that need more than the {pool.size} ranks started")
        cases = [c for c in cases if c.pool_size <= pool.size]
    out(f"ring-harness check: {len(cases)} cases, impl {impl}, {pool.backend} ranks "
        f"({opts.launcher}, {pool.size} ranks{placement_text(pool)})")
    mark = [time.perf_counter()]

    def lap(stage: str) -> None:
        """Close the stage that just ran: its wall time into res.stage_seconds."""
        now = time.perf_counter()
        res.stage_seconds[stage] = res.stage_seconds.get(stage, 0.0) + now - mark[0]
        mark[0] = now

    stopped_growth = _growth_stage(pool, opts, caps, res, out, failed)
    lap("growth")
    if stopped_growth:
        return finish(f"stopped at the growth check ({len(res.failures)} failing)")
    out(report.header())
    for i, c in enumerate(cases, 1):
        r = run_case(c, pool, impl, allow_import=allow_import)
        again = None
        if opts.repeat and resolved.deterministic and r.verdict in (Verdict.PASS, Verdict.SILENT_CORRUPTION):
            # (a run that hung or raised is not repeated: nothing to compare, and a hang costs its deadline)
            again = run_case(c, pool, impl, allow_import=allow_import, leak=False)
            repeat_check(r, again)
        res.results.append(r)
        res.cases += 1
        out(report.row(i, len(cases), r))
        for line in report.details(r):
            out(line)
        if not r.passed:
            save(r, again=again)
            if failed("battery", r):
                return finish(f"stopped at battery case {i} ({len(res.failures)} failing)")
    if probes:
        out(f"probing {len(probes)} case(s) with features {impl} does not declare:")
        for i, c in enumerate(probes, 1):
            r = run_case(c, pool, impl, allow_import=allow_import)
            res.probe_results.append(r)
            out(report.row(i, len(probes), r) + "  [" + ", ".join(unsupported(caps, c)) + "]")
            if not probe_acceptable(r):  # one file per distinct finding, confirmed on fresh ranks like a failure
                feats = tuple(unsupported(caps, c))
                save(r, note=f"undeclared feature probe: {', '.join(feats)}\n{r.verdict}: {r.case.summary()}\n"
                     f"{r.detail}", features=feats)
    for line in format_matrix(matrix(caps, res.results, res.probe_results, unprobed(caps, opts))):
        out(line)
    lap("battery")
    stopped_scale = _scale_stage(pool, opts, caps, res, out, failed, save)
    lap("scale")
    if stopped_scale:
        return finish(f"stopped at scale stage case {len(res.scale_results)} ({len(res.failures)} failing)")
    stopped_faults = _fault_stage(pool, opts, caps, res, out, failed, save)
    lap("faults")
    if stopped_faults:
        return finish(f"stopped at fault stage case {len(res.fault_results)} ({len(res.failures)} failing)")
    before, t_prop = res.cases, elapsed()
    res.prop = prop_stage.run_property(opts, pool, [r for r in res.results if not r.passed], reporter=out)
    lap("property")
    res.cases += res.prop.examples
    p = res.prop
    if p.found is not None:
        failed("property", p.found, p.shrunk)
        f = res.failures[-1]
        f.cases, f.seconds = before + (p.first_failure_example or 0), t_prop + (p.first_failure_s or 0.0)
    return finish()


PREFLIGHT = dict(world_size=2, total_len=8, layout="contiguous", mask=MaskSpec("causal"), heads_q=2, heads_kv=2,
                 head_dim=16, dtype="fp32", seed=1)


def preflight(pool, opts: CheckOptions, caps: Capabilities) -> CaseResult | None:
    """One small declared case before any stage: an implementation whose adapter is broken (it raises on every
    rank before communicating, or returns the wrong shape) is bad input, one line and exit 2, not a ring that
    fails every case (harness.judging.verdicts.adapter_error)."""
    c = adapt(caps, make_case(impl=opts.impl, **PREFLIGHT))
    if c is None or c.pool_size > pool.size:
        return
    if opts.deadline is not None:
        c = c.replace(deadline_s=opts.deadline)
    r = run_case(c, pool, opts.impl, allow_import=opts.allow_import, leak=False)
    line = adapter_error(r)
    if line is not None:
        raise HarnessError(f"{opts.impl}: {line} (a {c.summary()} case; fix the adapter, then run the check again)")
    return r


def shape_plan(opts: CheckOptions, caps: Capabilities, pool_size: int | None = None):
    """(the user's shape plan with its runs' deadlines, its estimate), refused in one line when it cannot fit
    or exceeds --shape-budget (harness.checks.shape)."""
    from harness.checks import shape as shape_mod

    p = shape_mod.plan(shape_mod.parse_shape(opts.shape), caps, opts.impl, opts.dtype, pool_size)
    if not opts.growth:
        p.growth = []
    rates = shape_mod.Rates.measure()
    est = shape_mod.estimate(p, rates)
    shape_mod.refuse_or_accept(p, est, opts.shape_budget, opts.dtype)

    def timed(c: Case) -> Case:
        return c.replace(deadline_s=opts.deadline or shape_mod.deadline(c, rates))

    p.basics = [timed(c) for c in p.basics]
    p.growth = [{w: timed(c) for w, c in g.items()} for g in p.growth]
    return p, est


def _shape_run(pool, opts: CheckOptions, caps: Capabilities, res: CheckOutcome, out: Reporter,
               failed: Callable[..., bool], save: Callable[[CaseResult], None]) -> None:
    """`--shape`: the growth check, then the basics, at exactly the user's shape (each basic run once, with the
    leak run); the estimate first."""
    from harness.judging import oracle

    p, est = shape_plan(opts, caps, None if hasattr(pool, "ensure") else pool.size)  # a local pool grows to W
    res.shape = p.shape.spec()
    out(f"shape {p.shape.spec()}: {len(p.basics)} basics (layout x mask x dtype) + "
        f"{sum(len(g) for g in p.growth)} growth-check runs (W {', '.join(map(str, p.growth_worlds))}); estimate "
        f"here: {est.words()}")
    for line in p.left_out:
        out(f"    not declared, left out: {line}")
    t0 = time.perf_counter()
    if p.growth:
        res.growth = g = growth_stage.growth_check(pool, opts, caps, out, planned=(p.growth_worlds, p.growth))
        res.cases += sum(len(c.results) for c in g.cases)
        for gc in g.failures:
            out(f"        -> {gc.detail}")
            if failed("growth", gc.results[gc.worst[0]], grown=gc):
                return
    res.stage_seconds["growth"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out(report.header())
    for i, c in enumerate(p.basics, 1):
        r = run_case(c, pool, opts.impl, allow_import=opts.allow_import)
        oracle.forget(c)  # judged: its references are not needed again
        res.shape_results.append(r)
        res.cases += 1
        out(report.row(i, len(p.basics), r))
        for line in report.details(r):
            out(line)
        if not r.passed:
            save(r)
            if failed("shape", r):
                return
    res.stage_seconds["shape basics"] = time.perf_counter() - t0


def scale_plan(opts: CheckOptions, caps: Capabilities) -> list[Case]:
    """The scale stage's cases for `opts` (none with --no-scale)."""
    if not opts.scale:
        return []
    return scale_cases(caps, opts.impl, opts.dtype, opts.deadline)


def _scale_stage(pool, opts: CheckOptions, caps: Capabilities, res: CheckOutcome, out: Reporter,
                 failed: Callable[[str, CaseResult], bool], save: Callable[[CaseResult], None]) -> bool:
    """Run the scale stage into `res`; True when the check should stop at one of its failures. Each case runs
    once (no repeat: the battery's repeat check covers state carried between calls), with the leak run."""
    cases = scale_plan(opts, caps)
    if not cases:
        return False
    impl, allow_import = opts.impl, opts.allow_import
    fit = [c for c in cases if c.pool_size <= pool.size]
    if len(fit) < len(cases):
        out(f"scale stage: skipping {len(cases) - len(fit)} case(s) that need more than the {pool.size} ranks started")
    out(f"scale stage: {len(fit)} cases at training sizes (kernel tiles {', '.join(map(str, caps.tiles))}: local "
        "lengths past 1, 2 and 4 tiles; positions past bf16's 256 and fp16's 2048; head_dim 64-128, GQA, batch)")
    for i, c in enumerate(fit, 1):
        r = run_case(c, pool, impl, allow_import=allow_import)
        res.scale_results.append(r)
        res.cases += 1
        out(report.row(i, len(fit), r))
        for line in report.details(r):
            out(line)
        if not r.passed:
            save(r)
            if failed("scale", r):
                return True
    return False


def _fault_stage(pool, opts: CheckOptions, caps: Capabilities, res: CheckOutcome, out: Reporter,
                 failed: Callable[[str, CaseResult], bool], save: Callable[[CaseResult], None]) -> bool:
    """Run the fault stage into `res`; True when the check should stop at one of its failures."""
    impl, allow_import = opts.impl, opts.allow_import
    kinds = parse_kinds(opts.fault_stage, FAULT_STAGE_KINDS, "--fault-stage", FAULT_STAGE_DEFAULT)
    if not kinds:
        return False
    lo, hi = caps.world_sizes
    deadline = min(opts.fault_deadline, opts.deadline or opts.fault_deadline)
    cases = fault_stage_cases(kinds, impl, caps, max_world=min(hi, pool.size), deadline_s=deadline, dtype=opts.dtype)
    cases = [c for c in cases if c.world_size >= lo]
    out(f"fault stage: {len(cases)} cases, {', '.join(kinds)} on every rank, both phases "
        "(results must not change)")
    for i, c in enumerate(cases, 1):
        r = run_case(c, pool, impl, allow_import=allow_import)
        res.fault_results.append(r)
        res.cases += 1
        out(report.row(i, len(cases), r) + f"  [{'+'.join(f['kind'] for f in c.faults)}]")
        if r.verdict == "invalid":
            out(f"        -> not applicable here: {r.detail[:200]}")
        elif not fault_ok(r):
            out(f"        -> {r.detail[:300]}" if r.detail else f"        -> {r.verdict}, expected pass")
            save(r)
            if failed("faults", r):
                return True
    return False


def _growth_stage(pool, opts: CheckOptions, caps: Capabilities, res: CheckOutcome, out: Reporter,
                  failed: Callable[..., bool]) -> bool:
    """Run the growth check into `res`; True when the check should stop at one of its failures. A failing
    global case is recorded with its worst ring size's run as the result (that run passes on its own:
    the failure is the figure, kept in `Failure.growth`)."""
    if not opts.growth:
        return False
    res.growth = g = growth_stage.growth_check(pool, opts, caps, out)
    res.cases += sum(len(c.results) for c in g.cases)
    # a growth run that hung cost its deadline like any other: it counts toward --max-hangs (the growth check
    # stops at it and records no failure; the battery's runs say what is wrong, and stop at the limit)
    res.hangs += sum(r.verdict == Verdict.HANG for c in g.cases for r in c.results.values())
    for gc in g.failures:
        w = gc.worst[0]
        out(f"        -> {gc.detail}")
        if failed("growth", gc.results[w], grown=gc):
            return True
    return False


def growth_pool_size(opts: CheckOptions, caps: Capabilities) -> int:
    """Ranks the growth check would like (its largest ring size the implementation declares); 0 when off."""
    if not opts.growth:
        return 0
    return max((w for w in growth_stage.WORLD_SIZES if caps.world_sizes[0] <= w <= caps.world_sizes[1]), default=0)


def outcome_json(res: CheckOutcome) -> dict:
    """Machine-readable results of a check (for --json)."""
    return {"impl": res.impl, "seconds": res.seconds, "passed": res.passed, "stopped": res.stopped,
            "results": [r.to_dict() for r in res.results],
            "scale": [r.to_dict() for r in res.scale_results],
            "shape": [r.to_dict() for r in res.shape_results],
            "stage_seconds": dict(res.stage_seconds), "cases_by_stage": dict(stage_counts(res)),
            "distinct_failures": 0 if res.passed else distinct_failures(res),
            "probes": [r.to_dict() for r in res.probe_results],
            "faults": [r.to_dict() for r in res.fault_results],
            "growth": None if res.growth is None else res.growth.to_dict(),
            "property": None if res.prop is None else prop_stage.outcome_json(res.prop)}


def placement_text(pool: object) -> str:
    """', on cuda, P2P staged ...' for a local pool off the plain CPU path; '' otherwise."""
    placement = getattr(pool, "placement", None)
    return "" if placement is None or not placement.staged else f", {placement.describe()}"


def check(opts: CheckOptions | None = None, reporter: Reporter | None = None) -> CheckOutcome:
    """The default check as a library call: open the ranks (`opts.launcher`), run `run_check`, print the
    summary (and write `opts.json`). Under torchrun, non-zero ranks return an empty outcome once rank 0
    is done. `outcome.passed` is the verdict; the command line exits 1 when it is False."""
    from harness.ranks.launch import open_pool

    opts = (opts or CheckOptions()).validate()
    out = reporter or report.out
    caps = registry.resolve(opts.impl, allow_import=opts.allow_import).capabilities
    if opts.shape is not None:  # the estimate (or the refusal) before any rank starts
        size = shape_plan(opts, caps)[0].shape.world_size
    else:
        cases, probes = battery_plan(opts, caps)
        size = max(battery_pool_size(cases + probes + scale_plan(opts, caps)), growth_pool_size(opts, caps))
    with open_pool(opts.launcher, opts.backend, size, opts.placement) as pool:
        if pool is None:  # a torchrun follower rank: rank 0 reports
            return CheckOutcome(impl=opts.impl, follower=True)
        if opts.world_size > pool.size:  # torchrun started fewer processes than the battery's main ring needs
            raise HarnessError(f"--world-size {opts.world_size} needs {opts.world_size} ranks but {opts.launcher} "
                               f"started {pool.size}: pass --world-size {pool.size} or start more processes")
        res = CheckOutcome(impl=opts.impl)
        t0 = time.perf_counter()
        try:
            if hasattr(pool, "ensure"):  # start the local pool's ranks now, so their start is not a stage's time
                pool.ensure(pool.size)
            res.stage_seconds["ranks start"] = time.perf_counter() - t0
            with oracle_mode(opts.oracle):
                run_check(pool, opts, reporter=out, outcome=res)
        except Interrupted as e:  # SIGINT/SIGTERM under harness.interrupt.handlers(): stop here, report what ran
            res.interrupted, res.stopped = e.signal, f"interrupted by {e.signal}"
            res.seconds = res.seconds or time.perf_counter() - t0
        except (KeyboardInterrupt, SystemExit):  # a library caller without the handlers: Ctrl-C as usual
            res.stopped = "interrupted"
            if opts.json:
                report.write_json(opts.json, {"command": "check", "interrupted": True, **outcome_json(res)})
                out(f"interrupted: what finished is in {opts.json}")
            raise
    out(counts_line(res))
    out("stages (wall s): " + ", ".join(f"{k} {v:.1f}" for k, v in res.stage_seconds.items()))
    out(verdict_line(res))
    if opts.json:
        report.write_json(opts.json, {"command": "check", "interrupted": bool(res.interrupted), **outcome_json(res)})
        if res.interrupted:
            out(f"interrupted: what finished is in {opts.json}")
    return res


def stage_counts(res: CheckOutcome) -> list[tuple[str, int]]:
    """What ran, by stage, in run order: (stage, cases); the one count the summary, the verdict line and the JSON
    use. A growth-check case is one run at one ring size; a property-based case is one generated example."""
    g = res.growth
    rows = [("growth check", sum(len(c.results) for c in g.cases) if g else 0), ("battery", len(res.results)),
            ("probes", len(res.probe_results)), ("scale", len(res.scale_results)),
            ("at your shape", len(res.shape_results)), ("fault stage", len(res.fault_results)),
            ("property-based", res.prop.examples if res.prop else 0)]
    return [(k, n) for k, n in rows if n]


def counts_line(res: CheckOutcome) -> str:
    """'386 cases in 84 s: growth check 16, battery 54, scale 7, fault stage 9, property-based 300'."""
    rows = stage_counts(res)
    return (f"{sum(n for _, n in rows)} cases in {res.seconds:.0f} s: "
            + (", ".join(f"{k} {n}" for k, n in rows) or "none"))


def _related(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Two failure signatures of one bug as far as counting goes: the same verdict and faults, and what failed in
    one is part of what failed in the other (a shrunk case often fails on fewer tensors than the case it came from)."""
    def split(sig):
        faults = tuple(x for x in sig if x.startswith("faults="))
        return sig[:1], faults, set(sig[1:]) - set(faults)

    (va, fa, wa), (vb, fb, wb) = split(a), split(b)
    return va == vb and fa == fb and (wa <= wb or wb <= wa)


def distinct_failures(res: CheckOutcome) -> int:
    """Distinct failures: one per saved file of the battery, scale and fault stages, the growth check's, and the
    property-based run's unless one of those is the same bug (`_related`)."""
    sigs = [tuple(k) for k in res.distinct]
    if res.growth is not None and not res.growth.passed:
        sigs.append(("growth",))
    if res.prop is not None and not res.prop.passed:
        found = [failure_signature(r) for r in (res.prop.found, res.prop.shrunk) if r is not None]
        if not any(_related(f, s) for f in found for s in sigs):
            sigs.append(found[0])
    return len(sigs)


def verdict_line(res: CheckOutcome) -> str:
    """The last line of a check: what its exit status means, which stage failed, how many distinct
    failures (one saved file each)."""
    if res.interrupted:
        from harness.interrupt import EXIT_CODES

        return (f"check INTERRUPTED by {res.interrupted} (exit {EXIT_CODES.get(res.interrupted, 1)}): stopped after "
                f"{res.cases} cases; nothing more was run")
    if res.passed:
        g = res.growth
        worst = max((c.worst for c in g.cases if c.worst), key=lambda x: x[2], default=None) if g else None
        grew = f"; the growth check's worst x{worst[2]:.2f} ({worst[1]} at W{worst[0]})" if worst else ""
        where = f" at shape {res.shape}" if res.shape else ""
        return f"check PASSED (exit 0): every case of {res.impl}{where} passed ({counts_line(res)}{grew})"
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
        stages.append(f"growth check {len(res.growth.failures)}/{len(res.growth.cases)} global cases ({gc.detail})")
    if res.prop is not None and not res.prop.passed:
        shown = res.prop.shrunk or res.prop.found
        stages.append(f"property-based ({shown.verdict}: {shown.case.summary()})")
    if res.findings:
        stages.append(f"{len(res.findings)} undeclared-feature finding(s)")
    why = f"; {res.stopped}" if res.stopped else ""
    return f"check FAILED (exit 1): {'; '.join(stages)}; {distinct_failures(res)} distinct failure(s){why}"


def repeat_check(first: CaseResult, again: CaseResult) -> None:
    """The "repeat" check (issue #19): the same case run twice in a row on the same ranks must give
    bit-identical outputs for a deterministic implementation. State carried over between calls (a
    gradient buffer cached and not zeroed, a stale receive buffer, a reused communicator) shows on the
    second call only; the first result then becomes `diverged`, with which shards differed."""
    if first.verdict not in (Verdict.PASS, Verdict.SILENT_CORRUPTION) or again.verdict in (Verdict.HANG,):
        return
    diffs = [f"{t}@rank{g}" for g, hs in sorted(first.hashes.items()) for t, h in sorted(hs.items())
             if again.hashes.get(g, {}).get(t) != h]
    if again.verdict != first.verdict and again.verdict != Verdict.PASS and not diffs:
        diffs = [f"verdict {again.verdict}"]
    first.extra["repeat"] = {"identical": not diffs, "diffs": diffs, "verdict": str(again.verdict)}
    if diffs:
        first.verdict = Verdict.DIVERGED
        more = f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else ""
        first.detail = ("repeat: the same case run again on the same ranks gave different results "
                        f"({', '.join(diffs[:6])}{more}; second run: {again.verdict}): state carried over "
                        "between calls" + (f"; first run: {first.detail}" if first.detail else ""))
