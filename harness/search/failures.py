"""The files a property-based run writes for its failures, and the cross-check of a shrunk one.

A failure is saved the moment it is found (`-found.yaml`), its best so far while shrinking
(`-shrunk.yaml`), then its final shrunk case with where the error is. A history-dependent one
is saved as a sequence of cases instead (`-found-sequence.yaml`, `-shrunk-sequence.yaml`).
harness.search.fuzz says why in this order.
"""

from __future__ import annotations

from pathlib import Path

from harness import case as case_mod
from harness.case import Case
from harness.diagnose import localise as localise_mod
from harness.ranks.pool import RankPool
from harness.result import CaseResult, Verdict, result_record
from harness.runner import run_case
from harness.search import history as history_mod
from harness.search.fresh_ranks import FreshRanks
from harness.search.outcome import Bug, FuzzOutcome
from harness.search.signature import Signature

SECOND_IMPL = "flash-ring"  # the independent flash-style ring a shrunk failure must also pass on


def slug(impl: str) -> str:
    """An implementation name as a file-name part."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in impl)


def failure_note(r: CaseResult, what: str, lines: list[str]) -> str:
    """A saved file's leading comment: this file's own case first, then where it came from."""
    return "\n".join([f"{r.verdict}: {r.case.summary()}", what, r.detail, *lines])


def save_failure(
    r: CaseResult,
    path: Path,
    note: str,
    *,
    impl_version: str = "unknown",
    backend: str = "gloo",
    extra: dict | None = None,
) -> Path:
    """Atomic write of a failing case with its recorded result.

    `extra` adds keys to the record, e.g. the localisation.
    """
    rec = result_record(r, impl_version, backend)
    rec.update(extra or {})
    return case_mod.save(r.case, path, result=rec, note=note)


def save_found(
    r: CaseResult,
    sig: Signature,
    found: history_mod.HistoryFinding | None,
    *,
    save_dir: Path,
    stem: str,
    what: str,
    impl_version: str,
    backend: str,
) -> tuple[Path, Path]:
    """Save a new failure before any shrinking: the case, or the sequence that makes it fail on
    fresh ranks. Returns the found file and the path its shrunk version will take."""
    lines = [f"signature: {sig.label()}"]
    if found is not None:
        lines.append(found.evidence())
    if found is not None and found.sequence is not None:
        note = f"{what}; shrunk version: {stem}-shrunk-sequence.yaml"
        saved = history_mod.save_sequence(
            found,
            save_dir / f"{stem}-found-sequence.yaml",
            impl_version=impl_version,
            backend=backend,
            note=note,
        )
        return saved, save_dir / f"{stem}-shrunk-sequence.yaml"
    if found is not None and found.history_dependent:
        lines.append(f"NOT A REPRODUCER on fresh ranks: {found.note}")
    note = failure_note(r, f"{what}; shrunk version: {stem}-shrunk.yaml", lines)
    saved = save_failure(
        r, save_dir / f"{stem}-found.yaml", note, impl_version=impl_version, backend=backend
    )
    return saved, save_dir / f"{stem}-shrunk.yaml"


def cross_check(case: Case, impl: str, pool: RankPool) -> tuple[str | None, str | None]:
    """The verdicts of a failing case on the reference and on SECOND_IMPL.

    Neither runs when it is the implementation itself: its verdict is then None. SECOND_IMPL's is
    "unsupported" when it cannot run the case here, e.g. on an NCCL pool.
    """
    ref = run_case(case, pool, "reference").verdict if impl != "reference" else None
    second = None
    if impl != SECOND_IMPL:
        r = run_case(case, pool, SECOND_IMPL)
        second = "unsupported" if _unsupported(r) else r.verdict
    return ref, second


def _unsupported(r: CaseResult) -> bool:
    """SECOND_IMPL could not run the case here: not a verdict on it."""
    return r.verdict == Verdict.FAIL_STOP and "unsupported here" in r.detail


def finish(
    out: FuzzOutcome, bug: Bug, pool: RankPool | None, *, impl_version: str, backend: str
) -> None:
    """Localise a bug's minimal failure, cross-check it on the reference and the second
    implementation, and write its final shrunk file."""
    r = bug.shrunk
    bug.localisation = localise_mod.localise(r, pool)
    label = bug.signature.label()
    extra = {"localisation": localise_mod.summary(bug.localisation), "signature": label}
    lines = [f"signature: {label}"]
    if pool is not None:
        bug.reference_verdict, bug.second_verdict = cross_check(r.case, r.impl, pool)
        extra.update(
            reference_verdict=bug.reference_verdict,
            second_verdict=bug.second_verdict,
            harness_disagreement=bug.disagreement,
        )
        if bug.disagreement:
            lines.append(
                f"HARNESS DISAGREEMENT: the shrunk case also fails on the reference "
                f"({bug.reference_verdict}) or on {SECOND_IMPL} ({bug.second_verdict}): "
                f"suspect the oracle or the tolerance"
            )
    what = (
        f"shrunk from {bug.found_path.name} ({bug.failures} failing runs of this signature, "
        f"{out.runs} runs, stop: {out.stop})"
    )
    note = failure_note(r, what, lines + [f"where: {f}" for f in bug.localisation.findings])
    bug.shrunk_path = save_failure(
        r, bug.shrunk_path, note, impl_version=impl_version, backend=backend, extra=extra
    )
    if bug is out.bugs[0]:
        out.shrunk_path = bug.shrunk_path


def _sequence_verdicts(bug: Bug, fresh: FreshRanks) -> None:
    """The shrunk sequence on fresh ranks, the reference then SECOND_IMPL in the bug's place."""
    seq, impl = bug.history.sequence, bug.shrunk.impl
    ref = None
    if impl != "reference":
        ref = fresh.run(seq, lambda s: "reference" if s.case.impl == impl else s.case.impl)
    bug.reference_verdict = None if ref is None else str(ref.verdict)
    if impl != SECOND_IMPL:
        second = fresh.run(seq, lambda s: SECOND_IMPL if s.case.impl == impl else s.case.impl)
        if second is None:
            bug.second_verdict = None
        elif _unsupported(second):
            bug.second_verdict = "unsupported"
        else:
            bug.second_verdict = str(second.verdict)


def finish_sequence(
    out: FuzzOutcome,
    bug: Bug,
    fresh: FreshRanks,
    shrink_budget: float,
    *,
    impl_version: str,
    backend: str,
    allow_import: bool,
) -> None:
    """A history-dependent bug: shrink its sequence on fresh ranks, cross-check it and write its
    `-shrunk-sequence.yaml`. The cross-check runs the same sequence on fresh ranks."""
    found = bug.history
    if found.sequence is None:  # no sequence reproduces it: nothing replayable to shrink
        bug.localisation = localise_mod.localise(bug.shrunk, None)
        bug.shrunk_path = bug.found_path
        return
    history_mod.shrink_sequence(found, fresh, budget_s=shrink_budget, allow_import=allow_import)
    r = bug.shrunk = found.reproducer
    # no probes: a re-run would not be in the sequence's place
    bug.localisation = localise_mod.localise(r, None)
    _sequence_verdicts(bug, fresh)
    lines = [f"signature: {bug.signature.label()}"]
    if bug.disagreement:
        lines.append(
            f"HARNESS DISAGREEMENT: the shrunk sequence also fails on the reference "
            f"({bug.reference_verdict}) or on {SECOND_IMPL} ({bug.second_verdict}): "
            f"suspect the oracle or the tolerance"
        )
    head = (
        f"shrunk as a sequence from {bug.found_path.name} ({found.shrink_tries} candidates, "
        f"each run as the whole sequence on fresh ranks; {out.runs} runs, stop: {out.stop})"
    )
    bug.shrunk_path = history_mod.save_sequence(
        found,
        bug.shrunk_path,
        impl_version=impl_version,
        backend=backend,
        note="\n".join([head, *lines]),
    )


def confirm_later(
    bug: Bug, found: history_mod.HistoryFinding, *, impl_version: str, backend: str
) -> None:
    """A failure found while another was shrunk, confirmed on fresh ranks when the run ends.

    Its found file is rewritten with the fresh run. A history-dependent one is replaced by its
    sequence.
    """
    bug.history = found
    if found.sequence is not None:
        old = bug.found_path
        stem = old.name[: -len("-found.yaml")]
        note = f"found while shrinking another failure; shrunk version: {stem}-shrunk-sequence.yaml"
        path = old.with_name(f"{stem}-found-sequence.yaml")
        bug.found_path = history_mod.save_sequence(
            found, path, impl_version=impl_version, backend=backend, note=note
        )
        # neither it nor hypothesis's best-so-far on warm ranks is a reproducer
        old.unlink(missing_ok=True)
        bug.shrunk_path.unlink(missing_ok=True)
        bug.shrunk_path = old.with_name(f"{stem}-shrunk-sequence.yaml")
        return
    r = found.reproducer
    lines = [f"signature: {bug.signature.label()}", found.evidence()]
    if found.history_dependent:
        lines.append(f"NOT A REPRODUCER on fresh ranks: {found.note}")
    bug.found = r
    save_failure(
        r,
        bug.found_path,
        failure_note(r, "found while shrinking another failure", lines),
        impl_version=impl_version,
        backend=backend,
    )
