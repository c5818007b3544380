"""The default check: `Check` runs one preflight case, then the stages in order.

`ring-harness check` and `ring-harness selftest` share it. Each stage is one module of
harness.checks.stages. `--shape` runs the shape stage alone. The summary lines come from
harness.checks.summary. docs/check.md walks through the stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from harness.case import make_case
from harness.checks import groups, report
from harness.checks.experiments import Lab
from harness.checks.options import CheckOptions
from harness.checks.outcome import CheckOutcome, ExitReason, Failure
from harness.checks.report import Reporter
from harness.checks.stages import Stage, battery, faults, growth, scale, shape
from harness.checks.stages import property as property_stage
from harness.checks.stages.growth import GrowthCase
from harness.checks.summary import counts_line, outcome_json, verdict_line
from harness.context import Capabilities
from harness.diagnose import localise
from harness.errors import HarnessError, Interrupted
from harness.impls import registry
from harness.impls.capabilities import adapt, without_inference, without_variants
from harness.judging.verdicts import adapter_error, failure_signature
from harness.oracle.mode import oracle_mode
from harness.ranks.launch import open_pool
from harness.result import CaseResult, Verdict, failure_path, save_result
from harness.runner import run_case
from harness.search import history
from ring_impl.masks import MaskSpec

# The growth check runs first. It is cheap, ~16 small runs. A per-step precision loss passes every
# single case, so after the battery it was found only after ~100 runs.
STAGES: tuple[Stage, ...] = (growth, battery, scale, faults, property_stage)

PREFLIGHT = dict(
    world_size=2,
    total_len=8,
    layout="contiguous",
    mask=MaskSpec("causal"),
    heads_q=2,
    heads_kv=2,
    head_dim=16,
    dtype="fp32",
    seed=1,
)

BARE_FUNCTION_NOTE = (
    "is a bare function, so it declares every feature (every layout, mask and dtype, GQA, "
    "uneven splits, W 1-8, subgroups) and every case runs as supported; to declare what it "
    "supports, wrap it: harness.Impl(name, run, capabilities=harness.Capabilities(...)) "
    "(README: 'Validating your own implementation')"
)


def placement_text(pool: object) -> str:
    """', on cuda, P2P staged ...' for a local pool off the plain CPU path; '' otherwise."""
    placement = getattr(pool, "placement", None)
    return "" if placement is None or not placement.staged else f", {placement.describe()}"


class Check:
    """One run of the default check of `opts.impl` on `pool`: its state, and one method per step.

    Results go into `outcome` as they come. A caller interrupted mid-check still holds what
    finished. Failing cases are saved under opts.save_dir as they happen.

    `stop_at_first_failure` ends the check at the first failing case that `accept` takes. Selftest
    accepts only failures that reproduce bit for bit. A failure it refuses is recorded, and the
    check goes on.
    """

    def __init__(
        self,
        pool,
        opts: CheckOptions,
        *,
        stop_at_first_failure: bool = False,
        accept: Callable[[CaseResult], bool] | None = None,
        reporter: Reporter | None = None,
        outcome: CheckOutcome | None = None,
    ):
        self.pool, self.opts = pool, opts
        self.reporter = reporter or report.out
        self.resolved = registry.resolve(opts.impl, allow_import=opts.allow_import)
        self.caps: Capabilities = self.resolved.capabilities
        if not opts.variants:
            self.caps = without_variants(self.caps)
        if not opts.inference:
            self.caps = without_inference(self.caps)
        self.version = str(getattr(self.resolved, "version", "unknown"))  # into saved files
        self.outcome = outcome if outcome is not None else CheckOutcome(impl=opts.impl)
        self.stop_at_first_failure = stop_at_first_failure
        self.accept = accept
        self.start = time.perf_counter()
        # What `accept` and the fresh-rank confirmations took: not the check's own time.
        self.paused = 0.0
        self.mark = self.start  # when the running stage started
        self.stage = ""  # the running stage's name
        self.why = ""  # the `stopped` text of the stage that stopped the check
        self.reason: ExitReason | None = None  # why a recorded failure stopped the check

    def elapsed(self) -> float:
        """The check's own time: without the time `accept` spends re-running failures."""
        return time.perf_counter() - self.start - self.paused

    def run(self) -> CheckOutcome:
        """Run the preflight case, then the stages in order, and return the outcome.

        With --shape, the shape stage runs alone.
        """
        opts, pool = self.opts, self.pool
        if not self.resolved.declared:
            self.reporter(f"note: {opts.impl} {BARE_FUNCTION_NOTE}")
        self.preflight()
        ranks = (
            f"{pool.backend} ranks ({opts.launcher}, {pool.capacity} ranks{placement_text(pool)})"
        )
        if opts.shape is not None:
            self.reporter(f"ring-harness check --shape: impl {opts.impl}, {ranks}")
            shape.run(self)
            return self.finish()
        cases, too_big = battery.fitting(self)
        if too_big:
            self.reporter(
                f"skipping {too_big} case(s) that need more than the {pool.capacity} ranks started"
            )
        self.reporter(f"ring-harness check: {len(cases)} cases, impl {opts.impl}, {ranks}")
        self.mark = time.perf_counter()
        for stage in STAGES:
            self.stage = stage.name
            if stage.run(self):
                return self.finish(self.why)
            self.lap(stage.name)
        return self.finish()

    def preflight(self) -> CaseResult | None:
        """Run one small declared case before any stage.

        A broken adapter is bad input. It raises on every rank before communicating, or it returns
        the wrong shape. The check then stops with one line and exit 2, rather than report a ring
        that fails every case (harness.judging.verdicts.adapter_error). A preflight case that hung
        cost its deadline, so it counts toward --max-hangs.
        """
        opts = self.opts
        c = adapt(self.caps, make_case(impl=opts.impl, **PREFLIGHT))
        if c is None or c.pool_size > self.pool.capacity:
            return None
        if opts.deadline is not None:
            c = c.replace(deadline_s=opts.deadline)
        r = run_case(c, self.pool, opts.impl, allow_import=opts.allow_import, leak=False)
        line = adapter_error(r)
        if line is not None:
            raise HarnessError(
                f"{opts.impl}: {line} (a {c.summary()} case; fix the adapter, "
                "then run the check again)"
            )
        if r.verdict == Verdict.HANG:
            self.outcome.hangs += 1
            self.reporter(f"preflight case hung: {r.detail[:200]}")
        return r

    def record_failure(
        self,
        stage: str,
        r: CaseResult,
        minimal: CaseResult | None = None,
        grown: GrowthCase | None = None,
    ) -> bool:
        """Record a failure, and say whether the check stops here.

        `accept` judges the minimal failure when there is one.
        """
        outcome, opts = self.outcome, self.opts
        seconds, t0 = self.elapsed(), time.perf_counter()
        ok = self.accept is None or self.accept(minimal or r)
        self.paused += time.perf_counter() - t0
        outcome.failures.append(Failure(stage, outcome.cases, seconds, r, ok, minimal, grown))
        if not ok:
            self.reporter(
                "        not accepted as this check's failure (it did not reproduce); going on"
            )
        reason = None
        if opts.maxfail is not None and len(outcome.failures) >= opts.maxfail:
            reason = ExitReason.MAXFAIL
        elif r.verdict == Verdict.HANG:
            outcome.hangs += 1
            if opts.max_hangs and outcome.hangs >= opts.max_hangs:
                reason = ExitReason.MAX_HANGS
        if reason is None and self.stop_at_first_failure and ok:
            reason = ExitReason.FIRST_FAILURE
        self.reason = reason or self.reason
        return reason is not None

    def save_failure(
        self,
        r: CaseResult,
        note: str | None = None,
        again: CaseResult | None = None,
        features: tuple[str, ...] = (),
        cause: tuple[str, ...] | None = None,
    ) -> None:
        """Save one file per failure group (its first case), confirmed on fresh ranks first.

        A failure that does not reproduce there is history-dependent. It is saved as the sequence of
        cases that does reproduce it (harness.search.history). `again` is the repeat check's second
        run of the case. `features` are a probe's undeclared features. A probe's finding is grouped
        with them, in outcome.finding_files. `cause` overrides the signature: a faulted case that
        fails the same way without faults is that failure (harness.checks.groups).
        """
        sig = (*sorted(features), *(cause or failure_signature(r)))
        table, what = self.outcome.distinct, "failure"
        if features:
            table, what = self.outcome.finding_files, "finding"
        if sig in table:
            table[sig][1] += 1
            self.reporter(
                f"        same {what} as {table[sig][0]} ({' '.join(sig)}): not saved again"
            )
            return
        t0 = time.perf_counter()
        repeat = again is not None and r.extra.get("repeat", {}).get("identical") is False
        if repeat and again.passed:
            path = self._save_bits_only(r, note)
            self.outcome.racy.add(sig)
            table[sig] = [path, 1]
            self.reporter(f"        saved {path} (history-dependent: NOT a reproducer on its own)")
            return
        # The repeat check's failing run is the second one.
        path = self._save_confirmed(again if repeat else r, sig, note, leak=not repeat)
        # The confirmation is not the check's own time.
        self.paused += time.perf_counter() - t0
        table[sig] = [path, 1]
        self.reporter(f"        {'finding ' if features else ''}saved {path}")

    def _save_bits_only(self, r: CaseResult, note: str | None) -> Path:
        """Save a repeat-check failure whose second run differs only in bits and passes alone.

        No failing run exists to reproduce. Replaying the case alone does not show the divergence.
        """
        text = "\n".join(
            filter(
                None,
                [
                    note,
                    f"{r.verdict}: {r.case.summary()}",
                    r.detail,
                    "history-dependent: the second "
                    "run differs in bits but passes on its own; replaying this case alone does not "
                    "reproduce the divergence",
                ],
            )
        )
        return save_result(
            r, self.opts.save_dir, backend=self.pool.backend, note=text, impl_version=self.version
        )

    def _save_confirmed(
        self, target: CaseResult, sig: tuple[str, ...], note: str | None, leak: bool
    ) -> Path:
        """Confirm `target` on fresh ranks, then save its reproducer: a case or a sequence."""
        opts, pool = self.opts, self.pool
        found = history.confirm(pool, target, opts.impl, leak=leak, allow_import=opts.allow_import)
        self.outcome.histories[sig] = found
        if found.history_dependent:
            # a sequence of cases reproduces it: history, not a race
            (self.outcome.racy if found.sequence is None else self.outcome.history).add(sig)
        for line in found.lines():
            self.reporter(line)
        if found.sequence is not None:
            stem = failure_path(opts.save_dir, found.reproducer).stem + "-sequence"
            return history.save_sequence(
                found,
                failure_path(opts.save_dir, found.reproducer, stem),
                backend=pool.backend,
                impl_version=self.version,
                note=note or "",
            )
        # The fresh run, when it confirmed the failure.
        rec = found.reproducer
        # Where the errors are, as for a property-based failure.
        loc = localise.localise(rec, pool)
        for line in localise.lines(loc):
            self.reporter(line)
        text = note or f"{rec.verdict}: {rec.case.summary()}\n{rec.detail}"
        text += f"\n{found.evidence()}"
        if found.history_dependent:
            text += f"; NOT A REPRODUCER: {found.note}"
        text += "".join(f"\nwhere: {f}" for f in loc.findings)
        extra = {"localisation": localise.summary(loc), "signature": " ".join(sig)}
        path = save_result(
            rec,
            opts.save_dir,
            backend=pool.backend,
            note=text,
            extra=extra,
            impl_version=self.version,
        )
        if opts.plot and loc.blocks:
            for p in property_stage.plot(loc, opts.plot, path.stem):
                self.reporter(f"        heatmap {p}")
        return path

    def stop(self, why: str, *, lap: bool = True) -> bool:
        """End the check after the running stage, with `why` as its `stopped` text.

        It returns True, which the stage returns in turn. With lap=False, the stage's wall time is
        not recorded.
        """
        if lap:
            self.lap(self.stage)
        self.why = why
        return True

    def lap(self, stage: str) -> None:
        """Close the stage that just ran: its wall time into outcome.stage_seconds."""
        now = time.perf_counter()
        seconds = self.outcome.stage_seconds
        seconds[stage] = seconds.get(stage, 0.0) + now - self.mark
        self.mark = now

    def finish(self, why: str = "") -> CheckOutcome:
        """The outcome, with its time and why the check stopped early, if it did."""
        outcome, max_hangs = self.outcome, self.opts.max_hangs
        if why and max_hangs and outcome.hangs >= max_hangs:
            why += (
                f": {outcome.hangs} hanging case(s), each waited out its deadline (--max-hangs "
                f"{max_hangs}; 0 runs every case)"
            )
        outcome.stopped, outcome.seconds = why, time.perf_counter() - self.start
        outcome.exit_reason = self.reason or ExitReason.FINISHED
        # Experiments explain each group. A check stopped early (selftest's first failure,
        # --maxfail, --max-hangs) runs none.
        lab = None if why or self.stop_at_first_failure else Lab.of(self)
        t0 = time.perf_counter()
        outcome.groups = groups.build(outcome, lab)
        if outcome.lab_runs:
            outcome.stage_seconds["experiments"] = time.perf_counter() - t0
            outcome.seconds = time.perf_counter() - self.start
        for line in groups.lines(outcome.groups):
            self.reporter(line)
        groups.annotate_saved(outcome.groups)
        return outcome


def run_check(
    pool,
    opts: CheckOptions,
    *,
    stop_at_first_failure: bool = False,
    accept: Callable[[CaseResult], bool] | None = None,
    reporter: Reporter | None = None,
    outcome: CheckOutcome | None = None,
) -> CheckOutcome:
    """Run the default check of `opts.impl` on `pool` (see `Check`)."""
    return Check(
        pool,
        opts,
        stop_at_first_failure=stop_at_first_failure,
        accept=accept,
        reporter=reporter,
        outcome=outcome,
    ).run()


def pool_size(opts: CheckOptions, caps: Capabilities) -> int:
    """Ranks the check asks for. With --shape, the estimate or the refusal comes before any rank."""
    if opts.shape is not None:
        return shape.ranks(opts, caps)
    return max(stage.ranks(opts, caps) for stage in STAGES)


def _run_on(pool, opts: CheckOptions, out: Reporter, res: CheckOutcome) -> None:
    """Start the ranks and run the check into `res`. A stop request ends it with what ran."""
    t0 = time.perf_counter()
    try:
        # Start the local pool's ranks now, so their start is not a stage's time.
        if hasattr(pool, "ensure"):
            pool.ensure(pool.size)
        res.stage_seconds["ranks start"] = time.perf_counter() - t0
        with oracle_mode(opts.oracle):
            run_check(pool, opts, reporter=out, outcome=res)
    # SIGINT/SIGTERM under harness.interrupt.handlers(): stop here, report what ran.
    except Interrupted as e:
        res.interrupted, res.stopped = e.signal, f"interrupted by {e.signal}"
        res.exit_reason = ExitReason.INTERRUPTED
        res.seconds = res.seconds or time.perf_counter() - t0
    # A library caller without the handlers: Ctrl-C as usual.
    except (KeyboardInterrupt, SystemExit):
        res.stopped, res.exit_reason = "interrupted", ExitReason.INTERRUPTED
        if opts.json:
            data = {"command": "check", "interrupted": True, **outcome_json(res)}
            report.write_json(opts.json, data)
            out(f"interrupted: what finished is in {opts.json}")
        raise


def check(opts: CheckOptions | None = None, reporter: Reporter | None = None) -> CheckOutcome:
    """The default check as a library call.

    It opens the ranks (`opts.launcher`), runs `run_check`, prints the summary and writes
    `opts.json`. Under torchrun, ranks other than 0 return an empty outcome once rank 0 is done.
    `outcome.passed` is the verdict, and the command line exits 1 when it is False.
    """
    opts = (opts or CheckOptions()).validate()
    out = reporter or report.out
    caps = registry.resolve(opts.impl, allow_import=opts.allow_import).capabilities
    size = pool_size(opts, caps)
    with open_pool(opts.launcher, opts.backend, size, opts.placement, opts.share_gpu) as pool:
        # A torchrun follower rank: rank 0 reports.
        if pool is None:
            return CheckOutcome(impl=opts.impl, follower=True)
        # torchrun started fewer processes than the battery's main ring needs.
        if opts.world_size > pool.size:
            n, size = opts.world_size, pool.size
            raise HarnessError(
                f"--world-size {n} needs {n} ranks but {opts.launcher} started "
                f"{size}: pass --world-size {size} or start more processes"
            )
        res = CheckOutcome(impl=opts.impl)
        _run_on(pool, opts, out, res)
    out(counts_line(res))
    out("stages (wall s): " + ", ".join(f"{k} {v:.1f}" for k, v in res.stage_seconds.items()))
    out(verdict_line(res))
    if opts.json:
        data = {"command": "check", "interrupted": bool(res.interrupted), **outcome_json(res)}
        report.write_json(opts.json, data)
        if res.interrupted:
            out(f"interrupted: what finished is in {opts.json}")
    return res
