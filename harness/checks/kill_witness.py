"""A selftest kill as a corpus witness: reproduced bit for bit, shrunk, saved.

A failure counts only if it reproduces on re-runs and once under perturbed timing. The kill is
shrunk to a minimal case (or a minimal sequence on fresh ranks), run on the reference, which must
pass, and saved as `mutant-NAME.yaml`. docs/check.md says what a kill must show.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from harness import case as case_mod
from harness import case_sequence
from harness.case import Case
from harness.checks.kill_matrix import REFERENCE, MutantRun, short
from harness.checks.options import CheckOptions
from harness.checks.outcome import Failure
from harness.faults.schema import make_fault
from harness.impls.capabilities import unsupported
from harness.impls.registry import resolve
from harness.judging.verdicts import failure_signature, killed_by
from harness.ranks.backend import Placement
from harness.result import CaseResult, Verdict, result_record
from harness.runner import run_case
from harness.search import history
from harness.search.fresh_ranks import FreshRanks
from harness.search.fuzz import PROFILES, impl_info
from harness.search.shrink import shrink

# A shrinking candidate that hangs costs at most this.
SHRINK_DEADLINE_S = 20.0
# extra runs a failure must reproduce bit for bit in to count (a race rarely does twice)
REPRODUCE_RUNS = 2


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
    with FreshRanks(placement=placement) as fr:
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
    caps = resolve(impl).capabilities

    def still_fails(c):
        if unsupported(caps, c):  # shrinking stays within what the ring declares
            return None
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


def shrink_and_save(
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
    ref = run_case(r.case, pool, base_reference(name))
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


def base_reference(name: str) -> str:
    """The reference a mutant was made from: the decode reference for the decode mutants
    (ring_impl.mutants.serving), the reference ring for the rest. Its comm count is the mutant's."""
    from ring_impl.mutants import MUTANTS

    fn = MUTANTS.get(short(name))
    return "reference-decode" if getattr(fn, "decode_form", None) else REFERENCE


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
    with FreshRanks(placement=opts.placement) as fr:
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
