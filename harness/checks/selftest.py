"""`ring-harness selftest`: would the default check have caught these bugs?

It runs the check against every mutant of the reference ring (ring_impl.mutants), and against the
reference itself. Each mutant is one real, publicly reported bug class. The result is a kill matrix.
A kill must reproduce bit for bit, and the reference must not fail once. docs/check.md says what a
kill must show, and how the false alarms and equivalent mutants are handled.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from harness import case as case_mod
from harness import case_sequence
from harness.case import Case
from harness.checks import report
from harness.checks.check import run_check
from harness.checks.kill_matrix import REFERENCE, MutantRun, SelftestOutcome, short
from harness.checks.options import CheckOptions, SelftestOptions
from harness.checks.outcome import CheckOutcome, Failure
from harness.checks.report import Reporter
from harness.errors import HarnessError
from harness.faults.schema import make_fault
from harness.impls.adapters.reference import MUTANT_PREFIX
from harness.judging.verdicts import failure_signature, killed_by
from harness.ranks.backend import Placement
from harness.result import CaseResult, Verdict, result_record
from harness.runner import run_case
from harness.search import history
from harness.search.fuzz import PROFILES, impl_info
from harness.search.shrink import shrink

# A shrinking candidate that hangs costs at most this.
SHRINK_DEADLINE_S = 20.0
# extra runs a failure must reproduce bit for bit in to count (a race rarely does twice)
REPRODUCE_RUNS = 2


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


def perturbed(c: Case) -> Case:
    """`c` with every communication op on every rank posted after a seeded random 0-10 ms.

    The program order is the same, under another timing. So a result that depends on a race shows
    it.
    """
    return c.replace(
        faults=(*c.faults, make_fault("delay", seconds=0.0, jitter=0.01, where="post"))
    )


def reproduces(pool, impl: str, r: CaseResult, times: int = 1) -> bool:
    """Whether a failure reproduces: the same verdict `times` more, and under perturbed timing once
    more.

    Completed runs must also give identical output hashes each time. A data race rarely survives
    both.
    """
    completed = r.verdict in (Verdict.PASS, Verdict.SILENT_CORRUPTION, Verdict.DIVERGED)
    for _ in range(times):
        again = run_case(r.case, pool, impl)
        if again.verdict != r.verdict or (completed and again.hashes != r.hashes):
            return False
    if completed and r.case.world_size >= 2:
        again = run_case(perturbed(r.case), pool, impl)
        return again.verdict == r.verdict and again.hashes == r.hashes
    return True


def sequence_reproduces(
    found: history.HistoryFinding, times: int = 1, placement: Placement | None = None
) -> bool:
    """Whether a history-dependent failure's sequence gives its recorded result bit for bit.

    It must, `times` more, each time on fresh ranks.
    """
    if found.sequence is None or found.seq_result is None:
        return False
    with history.FreshRanks(placement=placement) as fr:
        for _ in range(times):
            again = fr.run(found.sequence)
            if again is None or not history.same_run(again, found.seq_result):
                return False
    return True


def comm_difference(mut: CaseResult, ref: CaseResult) -> str:
    """How the mutant's op counts per phase differ from the reference's on the same case, or ''."""
    from harness.faults.interpose import phase_counts

    if mut.verdict in (Verdict.FAIL_STOP, Verdict.HANG) or ref.verdict != Verdict.PASS:
        return ""
    diffs: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for g, log in sorted(ref.extra.get("comm", {}).items()):
        a, b = phase_counts(mut.extra.get("comm", {}).get(g, [])), phase_counts(log)
        for phase in ("forward", "backward"):
            for kind in sorted(set(a.get(phase, {})) | set(b.get(phase, {}))):
                na, nb = a.get(phase, {}).get(kind, 0), b.get(phase, {}).get(kind, 0)
                if na != nb:
                    diffs.setdefault((phase, kind), []).append((na, nb))
    parts = []
    for (phase, kind), pairs in diffs.items():
        got = "/".join(str(p[0]) for p in pairs)
        want = "/".join(str(p[1]) for p in pairs)
        parts.append(f"{phase} {kind} {got} vs {want}")
    return "comm count: " + "; ".join(parts) + " (per rank, mutant vs reference)" if parts else ""


def corpus_note(name: str, run: MutantRun, kill: Failure) -> str:
    """The leading comment of a corpus case: what it reproduces, the public report, how it was
    found.
    """
    from ring_impl.mutants import MUTANTS

    doc = " ".join((MUTANTS[short(name)].__doc__ or "").split())
    r = run.shrunk
    lines = [f"{short(name)}: regression case for the bug class of {name} (ring_impl/mutants)."]
    lines += textwrap.wrap(doc, 100)
    checks = [c for c in killed_by(r) if c != r.verdict]
    by = f" ({', '.join(checks)})" if checks else ""
    how = (
        "by hypothesis"
        if kill.stage == "property"
        else f"greedily, {run.shrink_tries} candidates tried"
    )
    lines += textwrap.wrap(
        f"Found by `ring-harness selftest` (the default check, {kill.stage} stage, case "
        f"{kill.cases}, "
        f"{kill.seconds:.1f} s), shrunk ({how}) and confirmed bit for bit. "
        f"On {name} it must end {r.verdict}{by}; on the reference it must pass.",
        100,
    )
    if run.comm:
        lines.append(run.comm)
    return "\n".join(lines)


def _minimal(pool, impl: str, kill: Failure, opts: CheckOptions) -> tuple[CaseResult, int]:
    """The kill's minimal case: hypothesis's for a property-based failure, else greedy shrinking."""
    if kill.shrunk is not None:
        return kill.shrunk, 0

    def still_fails(c):
        c = c.replace(deadline_s=min(c.deadline_s, SHRINK_DEADLINE_S))
        r = run_case(c, pool, impl)
        if r.passed or r.verdict == Verdict.INVALID:
            return None
        return r if reproduces(pool, impl, r, REPRODUCE_RUNS) else None

    # the minimal case must fail the same way alone on fresh ranks
    def fresh(r: CaseResult) -> bool:
        return history.confirm(pool, r, impl, minimise=False).confirmed

    return shrink(
        kill.result, still_fails, budget_s=PROFILES[opts.profile].shrink_budget_s, fresh=fresh
    )


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
            _shrink_and_save(pool, name, run, kill, mopts, corpus or work)
        elif kill is None:
            run.note = "no failure reproduced bit for bit: no regression case saved"
    run.total_s = time.perf_counter() - t0
    return run


def _shrink_and_save(
    pool, name: str, run: MutantRun, kill: Failure, opts: CheckOptions, corpus: Path
) -> None:
    """Shrink the kill, confirm it, run it on the reference, compare op counts, save the corpus
    case.
    """
    found = (
        run.check.histories.get(failure_signature(kill.result)) if run.check is not None else None
    )
    if found is not None and found.history_dependent:
        _shrink_and_save_sequence(name, run, kill, found, opts, corpus)
        return
    r, run.shrink_tries = _minimal(pool, name, kill, opts)
    run.shrunk = r
    # once more: it goes into a corpus replayed bit for bit
    if not reproduces(pool, name, r, REPRODUCE_RUNS):
        run.note = "the minimal case did not reproduce bit for bit: no regression case saved"
        return
    ref = run_case(r.case, pool, REFERENCE)
    run.reference_verdict = ref.verdict
    run.comm = comm_difference(r, ref)
    if not ref.passed:
        run.note = f"the minimal case fails on the reference too ({ref.verdict}): suspect the harness; not saved"
        return
    rec = result_record(r, impl_info(name, False)[1], getattr(pool, "backend", "gloo"))
    run.path = case_mod.save(
        r.case,
        corpus / f"mutant-{short(name)}.yaml",
        result=rec,
        note=corpus_note(name, run, kill),
        expect="reproduce",
    )


def _shrink_and_save_sequence(
    name: str,
    run: MutantRun,
    kill: Failure,
    found: history.HistoryFinding,
    opts: CheckOptions,
    corpus: Path,
) -> None:
    """A history-dependent kill: shrink its sequence on fresh ranks, and confirm it.

    The same sequence then runs on the reference, which must pass. It is saved as the corpus's
    sequence case.
    """
    with history.FreshRanks(placement=opts.placement) as fr:
        history.shrink_sequence(found, fr, budget_s=PROFILES[opts.profile].shrink_budget_s)
        run.shrunk, run.shrink_tries = found.seq_result, found.shrink_tries
        if not sequence_reproduces(found, REPRODUCE_RUNS, opts.placement):
            run.note = "the minimal sequence did not reproduce bit for bit on fresh ranks: no regression case saved"
            return
        ref = fr.run(found.sequence, lambda s: REFERENCE if s.case.impl == name else s.case.impl)
    run.reference_verdict = None if ref is None else ref.verdict
    if ref is None or not ref.passed:
        run.note = f"the minimal sequence fails on the reference too ({run.reference_verdict}): suspect the harness"
        return
    n = len(found.sequence.steps)
    run.note = (
        f"history-dependent: passes alone on fresh ranks; its witness is a sequence of {n} "
        "cases run in "
        "order on fresh ranks"
    )
    note = (
        corpus_note(name, run, kill)
        + "\n"
        + "\n".join(
            textwrap.wrap(
                f"A sequence case: {found.evidence()}. `ring-harness replay` runs the {n} cases in "
                "order "
                "on fresh ranks; "
                "the last one is judged.",
                100,
            )
        )
    )
    rec = result_record(found.seq_result, impl_info(name, False)[1], "gloo")
    run.path = case_sequence.save_sequence(
        found.sequence,
        corpus / f"mutant-{short(name)}.yaml",
        result=rec,
        note=note,
        expect="reproduce",
    )


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
    from harness.checks import kill_matrix as km
    from harness.checks.options import FAULT_STAGE_DEFAULT, FAULT_STAGE_KINDS, parse_kinds
    from harness.ranks.leftovers import leftover_workers
    from harness.ranks.pool import RankPool
    from harness.search.battery import battery_pool_size, default_battery

    opts = (opts or SelftestOptions()).validate()
    out = reporter or report.out
    names = mutant_names(opts.only)
    copts = opts.check
    work = Path(opts.save_dir)
    corpus = Path(opts.corpus) if opts.corpus else None
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
    out(
        f"ring-harness selftest: {sum(n != REFERENCE for n in names)} mutant(s){ref} through the "
        "default check "
        f"(battery W{copts.world_size}, fault stage {stage}, property-based {prof.name}: "
        f"{prof.max_examples} "
        f"examples{'' if prof.time_budget_s == float('inf') else f' / {prof.time_budget_s:g} s'}), "
        f"{os.cpu_count()} "
        f"cores; logs in {work / 'logs'}"
    )
    out(km.COLS)
    pids: set[int] = set()
    start = time.perf_counter()

    def done(r: MutantRun) -> None:
        pids.update(pool.pids())
        if r.name != REFERENCE:
            out(km.row(r))
            for line in km.notes(r):
                out(line)

    from harness.checks.stages import growth
    from harness.context import Capabilities

    size = max(
        battery_pool_size(default_battery(copts.world_size)), growth.ranks(copts, Capabilities())
    )
    with RankPool(size, spare=True, placement=copts.placement) as pool:
        runs = run_selftest(
            pool, names, copts, work, corpus, false_alarm_cases=opts.false_alarm_cases, on_done=done
        )
        pids.update(pool.pids())
    res = SelftestOutcome(
        runs=runs, leftovers=leftover_workers(pids), seconds=time.perf_counter() - start
    )
    mutants, ref_run = res.mutants, res.reference
    median, worst, slowest = km.kill_times(runs)
    out("")
    if mutants:
        out(
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
            out(f"SURVIVED: {', '.join(survivors)}")
    if ref_run is not None:
        for line in km.false_alarm_lines(ref_run):
            out(line)
    out(f"selftest took {res.seconds:.0f} s; worker processes left behind: {len(res.leftovers)}")
    for line in res.leftovers:
        out(f"  {line}")
    if opts.json:
        report.write_json(
            opts.json,
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
    return res
