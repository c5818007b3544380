"""`ring-harness selftest`: would the default check have caught these bugs? Run it against every
mutant of the reference ring (ring_impl.mutants, one real, publicly reported bug class each) and
against the reference itself, and report a kill matrix.

Each mutant gets exactly what a user gets: `check`'s own default options (fixed battery, fault
stage, property-based run with the ci budget), through the same `run_check`, stopped at the first
failure. A failure counts as the kill only if it reproduces bit for bit on two re-runs and once
under perturbed timing (a data race, e.g. reading a receive buffer before waiting on plain gloo,
fails with different numbers from run to run; it is reported, and the check goes on to a
deterministic failure); the time to kill does not count those re-runs. The kill is shrunk (by
hypothesis for a property-based failure, by `harness.shrink` for a fixed case, each smaller
candidate also reproducing bit for bit), confirmed once more, run on the reference (which must
pass), and saved as `mutant-NAME.yaml`, a regression case for the `cases/` corpus. Its op log is
compared with the reference's on the same case ("comm count": a ring of W ranks makes W - 1 K/V
hops in forward).

The other side is false alarms: the reference runs through the same pipeline, with
`--false-alarm-cases N` property-based examples, and must not fail once; the worst error ratio
(error / allowed) of its passing cases is reported per dtype and tensor.

Equivalent mutants: a mutant no valid input can distinguish from the reference cannot be killed.
None is expected (each mutant's docstring says where it shows). One may be declared only in
EQUIVALENT, with the written argument why no input distinguishes it; it is still run and reported,
never silently skipped, and a kill of a declared-equivalent mutant is reported as a contradiction.
None is declared: every mutant of the zoo has a witness, its `cases/mutant-NAME.yaml`, a valid case
on which it and the reference differ (the corpus test replays both sides).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness import case as case_mod
from harness.case import Case
from harness.checks.check import CheckOutcome, Failure, run_check
from harness.errors import HarnessError
from harness.faults.schema import make_fault
from harness.impls.adapters.reference import MUTANT_PREFIX
from harness.result import result_record
from harness.runner import CaseResult, run_case
from harness.search.fuzz import PROFILES, impl_info
from harness.search.shrink import shrink

REFERENCE = "reference"
TENSORS = ("out", "lse", "dq", "dk", "dv")
SHRINK_DEADLINE_S = 20.0  # a shrinking candidate that hangs costs at most this
REPRODUCE_RUNS = 2  # extra runs a failure must reproduce bit for bit in to count (a race rarely does twice)

# Declared-equivalent mutants: name -> the argument why no valid case can tell it from the reference.
EQUIVALENT: dict[str, str] = {}


@dataclass
class MutantRun:
    """What selftest found for one implementation (a mutant, or the reference as the control)."""

    name: str
    status: str = "survived"  # killed | survived | pass | false-alarm
    stage: str = ""
    killed_by: list[str] = field(default_factory=list)
    verdict: str = ""
    cases: int = 0  # cases the check ran until the first failure (or in all)
    seconds: float | None = None  # from the check's start to the first failure
    total_s: float = 0.0
    racy: list[str] = field(default_factory=list)  # failures that did not reproduce
    shrunk: CaseResult | None = None
    shrink_tries: int = 0
    path: Path | None = None
    reference_verdict: str | None = None
    comm: str = ""
    note: str = ""
    log: Path | None = None
    check: CheckOutcome | None = None

    @property
    def ok(self) -> bool:
        """Killed (the reference: passed); a declared-equivalent mutant must survive instead."""
        if self.name in EQUIVALENT:
            return self.status == "survived"
        return self.status in ("killed", "pass")


def short(name: str) -> str:
    """'mutant:NAME' -> 'NAME'."""
    return name.removeprefix(MUTANT_PREFIX)


def mutant_names(only: str | None = None) -> list[str]:
    """`mutant:NAME` of the zoo, or of the comma list `only` (bare names; 'reference' is the control)."""
    from harness.impls.registry import mutant_names as all_names

    names = all_names()
    if only is None:
        return names + [REFERENCE]
    picked = []
    for n in (t.strip() for t in only.split(",") if t.strip()):
        full = n if n in (REFERENCE, *names) else MUTANT_PREFIX + n
        if full not in (*names, REFERENCE):
            raise HarnessError(f"--only: unknown mutant {n!r}; known: {', '.join(short(x) for x in names)}")
        picked.append(full)
    if not picked:
        raise HarnessError("--only: no mutant named")
    return list(dict.fromkeys(picked))


def check_args(**overrides) -> argparse.Namespace:
    """`check`'s own default options (the budgets a user gets), with `overrides`."""
    from harness.commands import check

    p = argparse.ArgumentParser()
    check.add_arguments(p)
    args = p.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def killed_by(r: CaseResult) -> list[str]:
    """Which checks a failing result failed: tensors, leak check, send-buffer check, fault verdict, verdict."""
    out = []
    if r.case.faults:
        out.append(f"fault verdict ({'+'.join(sorted({f['kind'] for f in r.case.faults}))})")
    bad = {c.tensor for c in r.failed_checks()}
    out += [t for t in TENSORS if t in bad]
    if r.leak is not None and not r.leak.passed:
        out.append("leak check")
    if r.extra.get("violations"):
        out.append("send-buffer check")
    if r.verdict in ("fail-stop", "hang", "diverged", "invalid"):
        out.append(r.verdict)
    return out


def perturbed(c: Case) -> Case:
    """`c` with every communication op on every rank posted after a seeded random 0-10 ms: the same
    program order under another timing, so a result that depends on a race shows it."""
    return c.replace(faults=(*c.faults, make_fault("delay", seconds=0.0, jitter=0.01, where="post")))


def reproduces(pool, impl: str, r: CaseResult, times: int = 1) -> bool:
    """The same verdict `times` more, with identical output hashes for completed runs, and the same
    hashes once more under perturbed timing (a data race rarely survives both)."""
    completed = r.verdict in ("pass", "silent-corruption", "diverged")
    for _ in range(times):
        again = run_case(r.case, pool, impl)
        if again.verdict != r.verdict or (completed and again.hashes != r.hashes):
            return False
    if completed and r.case.world_size >= 2:
        again = run_case(perturbed(r.case), pool, impl)
        return again.verdict == r.verdict and again.hashes == r.hashes
    return True


def comm_difference(mut: CaseResult, ref: CaseResult) -> str:
    """How the mutant's op counts per phase differ from the reference's on the same case ('' if not)."""
    from harness.faults.interpose import phase_counts

    if mut.verdict in ("fail-stop", "hang") or ref.verdict != "pass":
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
    """The leading comment of a corpus case: what it reproduces, the public report, how it was found."""
    from ring_impl.mutants import MUTANTS

    doc = " ".join((MUTANTS[short(name)].__doc__ or "").split())
    r = run.shrunk
    lines = [f"{short(name)}: regression case for the bug class of {name} (ring_impl/mutants)."]
    lines += textwrap.wrap(doc, 100)
    checks = [c for c in killed_by(r) if c != r.verdict]
    by = f" ({', '.join(checks)})" if checks else ""
    how = "by hypothesis" if kill.stage == "property" else f"greedily, {run.shrink_tries} candidates tried"
    lines += textwrap.wrap(
        f"Found by `ring-harness selftest` (the default check, {kill.stage} stage, case {kill.cases}, "
        f"{kill.seconds:.1f} s), shrunk ({how}) and confirmed bit for bit. "
        f"On {name} it must end {r.verdict}{by}; on the reference it must pass.", 100)
    if run.comm:
        lines.append(run.comm)
    return "\n".join(lines)


def _minimal(pool, impl: str, kill: Failure, args: argparse.Namespace) -> tuple[CaseResult, int]:
    """The kill's minimal case: hypothesis's for a property-based failure, else greedy shrinking."""
    if kill.shrunk is not None:
        return kill.shrunk, 0

    def still_fails(c):
        c = c.replace(deadline_s=min(c.deadline_s, SHRINK_DEADLINE_S))
        r = run_case(c, pool, impl)
        if r.passed or r.verdict == "invalid":
            return None
        return r if reproduces(pool, impl, r, REPRODUCE_RUNS) else None

    return shrink(kill.result, still_fails, budget_s=PROFILES[args.profile].shrink_budget_s)


def run_one(pool, name: str, args: argparse.Namespace, work: Path, corpus: Path | None) -> MutantRun:
    """Run the default check of `name`, stopped at its first reproducible failure; shrink and save it."""
    run = MutantRun(name=name, log=work / "logs" / f"{short(name)}.log")
    run.log.parent.mkdir(parents=True, exist_ok=True)
    margs = argparse.Namespace(**{**vars(args), "impl": name, "save_dir": str(work / "found" / short(name))})
    t0 = time.perf_counter()
    with open(run.log, "w", encoding="utf-8") as fh, contextlib.redirect_stdout(fh):
        res = run_check(pool, name, margs, stop_at_first_failure=True,
                        accept=lambda r: reproduces(pool, name, r, REPRODUCE_RUNS))
    run.check, run.cases = res, res.cases
    racy = [f for f in res.failures if not f.accepted]
    if racy:
        first = racy[0]
        run.racy = [f"{len(racy)} earlier failure(s) did not reproduce bit for bit on re-runs (a data race, "
                    f"caught but not replayable): the first at {first.stage} case {first.cases} after "
                    f"{first.seconds:.1f} s ({', '.join(killed_by(first.result))})"]
    kill = res.kill()
    if not res.failures:
        run.status = "pass" if name == REFERENCE else "survived"
    else:
        run.status = "false-alarm" if name == REFERENCE else "killed"
        f = kill or res.failures[0]
        run.stage, run.cases, run.seconds = f.stage, f.cases, f.seconds
        run.verdict, run.killed_by = f.result.verdict, killed_by(f.result)
        if kill is not None and name != REFERENCE:
            _shrink_and_save(pool, name, run, kill, margs, corpus or work)
        elif kill is None:
            run.note = "no failure reproduced bit for bit: no regression case saved"
    run.total_s = time.perf_counter() - t0
    return run


def _shrink_and_save(pool, name: str, run: MutantRun, kill: Failure, args: argparse.Namespace,
                     corpus: Path) -> None:
    """Shrink the kill, confirm it, run it on the reference, compare op counts, save the corpus case."""
    r, run.shrink_tries = _minimal(pool, name, kill, args)
    run.shrunk = r
    if not reproduces(pool, name, r, REPRODUCE_RUNS):  # once more: it goes into a corpus replayed bit for bit
        run.note = "the minimal case did not reproduce bit for bit: no regression case saved"
        return
    ref = run_case(r.case, pool, REFERENCE)
    run.reference_verdict = ref.verdict
    run.comm = comm_difference(r, ref)
    if not ref.passed:
        run.note = f"the minimal case fails on the reference too ({ref.verdict}): suspect the harness; not saved"
        return
    rec = result_record(r, impl_info(name, False)[1], getattr(pool, "backend", "gloo"))
    run.path = case_mod.save(r.case, corpus / f"mutant-{short(name)}.yaml", result=rec,
                             note=corpus_note(name, run, kill))


def false_alarm_args(args: argparse.Namespace, cases: int | None) -> argparse.Namespace:
    """The reference's options: `cases` property-based examples with no time limit (None: as given)."""
    if cases is None:
        return args
    return argparse.Namespace(**{**vars(args), "max_examples": cases, "time_budget": 7 * 24 * 3600.0})


def run_selftest(pool, names: list[str], args: argparse.Namespace, work: Path, corpus: Path | None, *,
                 false_alarm_cases: int | None = None,
                 on_done: Callable[[MutantRun], None] | None = None) -> list[MutantRun]:
    """Every named implementation through `run_one`, in order (the reference with its false-alarm
    budget); `on_done` sees each as it finishes."""
    from harness.search.battery import default_battery

    run_case(default_battery(args.world_size)[0], pool, REFERENCE)  # warm-up: no mutant pays the pool's start
    out = []
    for name in names:
        a = false_alarm_args(args, false_alarm_cases) if name == REFERENCE else args
        run = run_one(pool, name, a, work, corpus)
        out.append(run)
        if on_done is not None:
            on_done(run)
    return out


def kill_times(runs: list[MutantRun]) -> tuple[float | None, float | None, str]:
    """(median, worst seconds to the first failure over killed mutants, the slowest mutant)."""
    killed = [r for r in runs if r.status == "killed" and r.seconds is not None]
    if not killed:
        return None, None, ""
    worst = max(killed, key=lambda r: r.seconds)
    return statistics.median(r.seconds for r in killed), worst.seconds, worst.name


def worst_ratios(res: CheckOutcome) -> dict[str, dict[str, float]]:
    """dtype -> tensor -> worst error ratio over every passing case of a check (all three stages)."""
    out: dict[str, dict[str, float]] = {}
    for r in res.results + res.fault_results:
        if r.passed:
            per = out.setdefault(r.case.dtype, {})
            for t in TENSORS:
                if r.worst(t) is not None:
                    per[t] = max(per.get(t, 0.0), r.worst(t))
    if res.prop is not None:
        for dt, per_t in res.prop.worst_pass_tensor.items():
            per = out.setdefault(dt, {})
            for t, x in per_t.items():
                per[t] = max(per.get(t, 0.0), x)
    return out


# -- report ----------------------------------------------------------------------------------------

COLS = f"{'mutant':<27} {'verdict':<9} {'stage':<8} {'cases':>5} {'secs':>6}  {'killed by':<40}  shrunk case"


def row(r: MutantRun) -> str:
    """One line of the kill matrix."""
    by = ", ".join(r.killed_by) or "-"
    secs = f"{r.seconds:6.1f}" if r.seconds is not None else f"{r.total_s:6.1f}"
    where = "-"
    if r.shrunk is not None:
        where = f"{r.path or 'not saved'}: {r.shrunk.case.summary()}"
    status = r.status + ("*" if r.name in EQUIVALENT else "")
    return f"{short(r.name):<27} {status:<9} {r.stage or '-':<8} {r.cases:>5} {secs}  {by:<40}  {where}"


def notes(r: MutantRun) -> list[str]:
    """Indented lines under a row: races seen, comm count, the reference's verdict, problems."""
    lines = [f"    {x}" for x in r.racy]
    if r.comm:
        lines.append(f"    also caught by the {r.comm}")
    if r.note:
        lines.append(f"    {r.note}")
    if r.name in EQUIVALENT:
        lines.append(f"    declared equivalent: {EQUIVALENT[r.name]}")
        if r.status == "killed":
            lines.append("    CONTRADICTION: declared equivalent but killed: the written argument is wrong")
    return lines


def false_alarm_lines(r: MutantRun) -> list[str]:
    """The reference's side: cases run, failures, worst passing ratio per dtype and tensor."""
    res = r.check
    n_prop = res.prop.examples if res.prop else 0
    lines = [f"reference (false alarms): {res.cases} cases ({len(res.results)} battery, {len(res.fault_results)} "
             f"fault stage, {n_prop} property-based) in {r.total_s:.0f} s: "
             f"{'0 failures' if r.status == 'pass' else 'FAILED: ' + r.verdict + ' ' + ', '.join(r.killed_by)}"]
    for dt, per in sorted(worst_ratios(res).items()):
        cells = "  ".join(f"{t} {per[t]:.3f}" for t in TENSORS if t in per)
        lines.append(f"    worst passing ratio (error / allowed), {dt}: max {max(per.values()):.3f}  [{cells}]")
    return lines


def run_json(r: MutantRun) -> dict:
    """Machine-readable row."""
    return {"name": r.name, "status": r.status, "ok": r.ok, "stage": r.stage, "killed_by": r.killed_by,
            "verdict": r.verdict, "cases": r.cases, "seconds_to_first_failure": r.seconds, "total_s": r.total_s,
            "racy_failures": r.racy, "shrunk": None if r.shrunk is None else r.shrunk.case.summary(),
            "shrink_tries": r.shrink_tries, "path": None if r.path is None else str(r.path),
            "reference_verdict": r.reference_verdict, "comm": r.comm, "note": r.note,
            "log": None if r.log is None else str(r.log),
            "worst_pass_ratio": worst_ratios(r.check) if r.check is not None and r.name == REFERENCE else None}
