"""`ring-harness selftest`: would the default check have caught these bugs?

It runs the check against every mutant of the reference ring (ring_impl.mutants), and against the
reference itself. Each mutant is one real, publicly reported bug class. The result is a kill matrix.
A kill must reproduce bit for bit, and the reference must not fail once. docs/check.md says what a
kill must show, and how the false alarms and equivalent mutants are handled.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

from harness.checks import kill_matrix as km
from harness.checks import report
from harness.checks.check import run_check
from harness.checks.kill_matrix import REFERENCE, MutantRun, SelftestOutcome, short
from harness.checks.kill_witness import (
    REPRODUCE_RUNS,
    reproduces,
    sequence_reproduces,
    shrink_and_save,
)
from harness.checks.options import (
    FAULT_STAGE_DEFAULT,
    FAULT_STAGE_KINDS,
    CheckOptions,
    SelftestOptions,
    parse_kinds,
)
from harness.checks.outcome import CheckOutcome
from harness.checks.report import Reporter
from harness.errors import HarnessError
from harness.impls.adapters.reference import MUTANT_PREFIX
from harness.judging.verdicts import failure_signature, killed_by
from harness.result import CaseResult
from harness.runner import run_case
from harness.search.fuzz import PROFILES


def mutant_names(only: str | tuple[str, ...] | None = None) -> list[str]:
    """`mutant:NAME` of the zoo, or of the comma list `only`.

    `only` holds bare names. 'reference' is the control.
    """
    from harness.impls.registry import mutant_names as all_names

    names = all_names()
    if only is None:
        return names + [REFERENCE]
    picked = []
    items = only.split(",") if isinstance(only, str) else list(only)
    for n in (t.strip() for t in items if t.strip()):
        full = n if n in (REFERENCE, *names) else MUTANT_PREFIX + n
        if full not in (*names, REFERENCE):
            raise HarnessError(
                f"--only: unknown mutant {n!r}; known: {', '.join(short(x) for x in names)}"
            )
        picked.append(full)
    if not picked:
        raise HarnessError("--only: no mutant named")
    return list(dict.fromkeys(picked))


def run_one(pool, name: str, opts: CheckOptions, work: Path, corpus: Path | None) -> MutantRun:
    """Run the default check of `name`, stopped at its first reproducible failure. Shrink and save
    it.

    The check's lines go to the mutant's log file, through its own reporter.
    """
    run = MutantRun(name=name, log=work / "logs" / f"{short(name)}.log")
    run.log.parent.mkdir(parents=True, exist_ok=True)
    mopts = opts.with_(impl=name, save_dir=str(work / "found" / short(name)))
    t0 = time.perf_counter()
    res = CheckOutcome(impl=name)

    def accept(r: CaseResult) -> bool:
        """Whether a failure reproduces bit for bit.

        For a history-dependent failure (harness.search.history), its sequence must, on fresh ranks.
        """
        found = res.histories.get(failure_signature(r))
        if found is not None and found.history_dependent:
            return sequence_reproduces(found, REPRODUCE_RUNS, opts.placement)
        return reproduces(pool, name, r, REPRODUCE_RUNS)

    with open(run.log, "w", encoding="utf-8") as fh:
        run_check(
            pool,
            mopts,
            stop_at_first_failure=True,
            reporter=Reporter(fh),
            accept=accept,
            outcome=res,
        )
    run.check, run.cases = res, res.cases
    racy = [f for f in res.failures if not f.accepted]
    if racy:
        first = racy[0]
        run.racy = [
            f"{len(racy)} earlier failure(s) did not reproduce bit for bit on re-runs (a "
            "data race, "
            f"caught but not replayable): the first at {first.stage} case {first.cases} "
            "after "
            f"{first.seconds:.1f} s ({', '.join(killed_by(first.result))})"
        ]
    kill = res.kill()
    if not res.failures:
        run.status = "pass" if name == REFERENCE else "survived"
    else:
        run.status = "false-alarm" if name == REFERENCE else "killed"
        f = kill or res.failures[0]
        run.stage, run.cases, run.seconds = f.stage, f.cases, f.seconds
        run.verdict, run.killed_by = f.result.verdict, killed_by(f.result)
        # no single case fails: the figure is the witness, re-run bit for bit
        if f.growth is not None:
            run.verdict, run.killed_by = "growth", [f"error grows with W: {f.growth.detail}"]
            if kill is not None and name != REFERENCE:
                run.note = (
                    "growth-check kill: no single case fails, so no regression case is "
                    "saved; its witness "
                    "is the growth figure (tests/checks/test_growth.py)"
                )
        elif kill is not None and name != REFERENCE:
            shrink_and_save(pool, name, run, kill, mopts, corpus or work)
        elif kill is None:
            run.note = "no failure reproduced bit for bit: no regression case saved"
    run.total_s = time.perf_counter() - t0
    return run


def false_alarm_options(opts: CheckOptions, cases: int | None) -> CheckOptions:
    """The reference's options: `cases` property-based examples, with no time limit.

    None keeps them as given.
    """
    if cases is None:
        return opts
    return opts.with_(max_examples=cases, time_budget=7 * 24 * 3600.0)


def run_selftest(
    pool,
    names: list[str],
    opts: CheckOptions,
    work: Path,
    corpus: Path | None,
    *,
    false_alarm_cases: int | None = None,
    on_done: Callable[[MutantRun], None] | None = None,
) -> list[MutantRun]:
    """Every named implementation through `run_one`, in order. `on_done` sees each as it finishes.

    The reference gets its false-alarm budget.
    """
    from harness.search.battery import default_battery

    # warm-up: no mutant pays the pool's start
    run_case(default_battery(opts.world_size)[0], pool, REFERENCE)
    out = []
    for name in names:
        a = false_alarm_options(opts, false_alarm_cases) if name == REFERENCE else opts
        run = run_one(pool, name, a, work, corpus)
        out.append(run)
        if on_done is not None:
            on_done(run)
    return out


def selftest(
    opts: SelftestOptions | None = None, reporter: Reporter | None = None
) -> SelftestOutcome:
    """`ring-harness selftest` as a library call.

    Every named mutant, then the reference, runs through the default check on one pool. It prints
    the kill matrix and the false-alarm figures, and writes opts.json. `outcome.passed` means every
    mutant was killed, the reference passed, and no worker process was left behind.
    """
    opts = (opts or SelftestOptions()).validate()
    out = reporter or report.out
    names = mutant_names(opts.only)
    work = Path(opts.save_dir)
    corpus = Path(opts.corpus) if opts.corpus else None
    out(_header(opts, names, work))
    out(km.COLS)
    res = _run_all(opts, names, work, corpus, out)
    times = km.kill_times(res.runs)
    for line in _summary_lines(res, times):
        out(line)
    if opts.json:
        _write_json(opts.json, res, times)
    return res


def _header(opts: SelftestOptions, names: list[str], work: Path) -> str:
    """The first line: what runs, through which stages and budget, and where the logs go."""
    copts = opts.check
    prof = PROFILES[copts.profile]
    ref = ""
    if REFERENCE in names:
        n = opts.false_alarm_cases
        ref = " and the reference" + (
            f" (with {n} property-based examples, no time limit)" if n else ""
        )
    stage = ",".join(
        parse_kinds(copts.fault_stage, FAULT_STAGE_KINDS, "--fault-stage", FAULT_STAGE_DEFAULT)
    )
    return (
        f"ring-harness selftest: {sum(n != REFERENCE for n in names)} mutant(s){ref} through the "
        "default check "
        f"(battery W{copts.world_size}, fault stage {stage}, property-based {prof.name}: "
        f"{prof.max_examples} "
        f"examples{'' if prof.time_budget_s == float('inf') else f' / {prof.time_budget_s:g} s'}), "
        f"{os.cpu_count()} "
        f"cores; logs in {work / 'logs'}"
    )


def _show_run(out: Reporter, pool, pids: set[int], r: MutantRun) -> None:
    """Note the pool's worker pids, and print a mutant's row of the kill matrix as it finishes."""
    pids.update(pool.pids())
    if r.name != REFERENCE:
        out(km.row(r))
        for line in km.notes(r):
            out(line)


def _run_all(
    opts: SelftestOptions, names: list[str], work: Path, corpus: Path | None, out: Reporter
) -> SelftestOutcome:
    """Every named implementation on one spare pool, then the check for leftover workers."""
    from harness.checks.stages import growth
    from harness.context import Capabilities
    from harness.ranks.leftovers import leftover_workers
    from harness.ranks.pool import RankPool
    from harness.search.battery import battery_pool_size, default_battery

    copts = opts.check
    pids: set[int] = set()
    start = time.perf_counter()
    size = max(
        battery_pool_size(default_battery(copts.world_size)), growth.ranks(copts, Capabilities())
    )
    with RankPool(size, spare=True, placement=copts.placement) as pool:
        runs = run_selftest(
            pool,
            names,
            copts,
            work,
            corpus,
            false_alarm_cases=opts.false_alarm_cases,
            on_done=functools.partial(_show_run, out, pool, pids),
        )
        pids.update(pool.pids())
    return SelftestOutcome(
        runs=runs, leftovers=leftover_workers(pids), seconds=time.perf_counter() - start
    )


def _summary_lines(
    res: SelftestOutcome, times: tuple[float | None, float | None, str]
) -> list[str]:
    """The lines under the kill matrix: kills, survivors, false alarms, time and leftovers."""
    mutants, ref_run = res.mutants, res.reference
    median, worst, slowest = times
    lines = [""]
    if mutants:
        lines.append(
            f"{res.killed}/{len(mutants)} mutants killed"
            + (
                f"; time to first failure: median {median:.1f} s, worst {worst:.1f} s "
                f"({short(slowest)})"
                if median is not None
                else ""
            )
        )
        survivors = [short(r.name) for r in mutants if r.status != "killed"]
        if survivors:
            lines.append(f"SURVIVED: {', '.join(survivors)}")
    if ref_run is not None:
        lines += km.false_alarm_lines(ref_run)
    lines.append(
        f"selftest took {res.seconds:.0f} s; worker processes left behind: {len(res.leftovers)}"
    )
    lines += [f"  {line}" for line in res.leftovers]
    return lines


def _write_json(
    path: str, res: SelftestOutcome, times: tuple[float | None, float | None, str]
) -> None:
    """The selftest's machine-readable results (--json)."""
    mutants, ref_run = res.mutants, res.reference
    median, worst, _ = times
    report.write_json(
        path,
        {
            "command": "selftest",
            "mutants": [km.run_json(r) for r in mutants],
            "reference": None if ref_run is None else km.run_json(ref_run),
            "killed": res.killed,
            "median_kill_s": median,
            "worst_kill_s": worst,
            "leftovers": res.leftovers,
        },
    )
