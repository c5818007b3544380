"""The property-based run: hypothesis (in the parent only) draws Cases, each example is one
`run_case` on the persistent rank pool, and a failure is saved, shrunk and saved again.

Saving order is what makes a failure impossible to lose: the first failing case is written
atomically (`...-found.yaml`) the moment it is seen, before shrinking starts; every smaller
failure hypothesis finds while shrinking overwrites `...-shrunk.yaml` (atomic rename), and the
final minimal case is written there with its localisation. Hypothesis's example database is not
used: the YAML file is the record.

Shrinking keeps the failure's signature (harness.search.signature: verdict, failing tensors or the
leak, error class; one implementation): each signature is raised as an exception type of its own and
hypothesis runs with report_multiple_bugs, so it shrinks every signature separately and never slips
from one to another. A failure with a new signature is a different bug: it gets its own `-found.yaml`
and `-shrunk.yaml` (FuzzOutcome.bugs); the first one found is the outcome's `found`/`shrunk`. A shrunk
case is run on the reference and on the second independent implementation (SECOND_IMPL); if either
fails it too, it is reported as a harness disagreement (suspect the oracle or the tolerance) rather
than a bug of the implementation.

Fresh-rank confirmations (issue #19, harness.search.history) are interleaved with the search: a new
failure is re-run alone on fresh ranks before its `-found.yaml` is written. One that does not
reproduce there is history-dependent: the run stops, the sequence of earlier cases that makes it
reproduce on fresh ranks is minimised and saved (`-found-sequence.yaml`), then shrunk as a sequence
(`-shrunk-sequence.yaml`). A failure that did reproduce fresh is shrunk by hypothesis on the warm
ranks, and its minimal case is confirmed the same way; one that fails only on the warm ranks is
refused and the shrinker steps back through the smaller-so-far failures to the newest that fails alone
on fresh ranks (at most MAX_SHRUNK_CONFIRMATIONS tries, else the found case), so shrinking never swaps
a bug for a history effect. Every saved single case records its fresh run.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from harness import case as case_mod
from harness.case import Case
from harness.context import Capabilities
from harness.diagnose import localise as localise_mod
from harness.errors import HarnessError
from harness.ranks.pool import RankPool
from harness.result import CaseResult, result_record
from harness.runner import run_case
from harness.search import history as history_mod
from harness.search import strategies
from harness.search.shrink import case_size
from harness.search.signature import CaseFailed, Signature, raise_failure

try:
    ExceptionGroupType = BaseExceptionGroup  # noqa: F821 - a builtin from Python 3.11
except NameError:  # Python 3.10: the backport hypothesis itself depends on
    from exceptiongroup import BaseExceptionGroup as ExceptionGroupType

SECOND_IMPL = "flash-ring"  # the independent flash-style ring a shrunk failure must also pass on
MAX_SHRUNK_CONFIRMATIONS = 6  # fresh-rank confirmations of shrunk candidates, newest first


@dataclass(frozen=True)
class Profile:
    """A hypothesis budget: examples, seconds of search, runs and seconds of shrinking, fixed or random seed,
    and how large the drawn cases may be (strategies.SIZES). A profile whose bounds are counts (examples,
    shrink_runs) runs the same cases on any machine; its seconds are a safety stop, reported when hit."""

    name: str
    max_examples: int
    time_budget_s: float
    shrink_budget_s: float
    derandomize: bool
    sizes: strategies.Sizes | None = None
    shrink_runs: int | None = None  # runs after the first failure (shrinking every failure); None: seconds only


SHRINK_SAFETY = 5.0  # a profile with shrink_runs stops shrinking after this x shrink_budget_s all the same

PROFILES = {
    # the default `check`: a fixed, reproducible search, the same 300 cases and the same shrinking (300 runs)
    # whatever the machine's load (no search time budget: a slow machine takes longer rather than testing
    # less; SHRINK_SAFETY x 60 s of shrinking is a safety stop); about a minute on 2 cores for a passing ring
    "ci": Profile("ci", max_examples=300, time_budget_s=math.inf, shrink_budget_s=60.0, derandomize=True,
                  sizes=strategies.SIZES["ci"], shrink_runs=300),
    # long random search for scheduled runs
    "nightly": Profile("nightly", max_examples=50_000, time_budget_s=3600.0, shrink_budget_s=600.0, derandomize=False,
                       sizes=strategies.SIZES["nightly"]),
}


@dataclass
class Bug:
    """One distinct failure (signature) of a property-based run: found, saved, shrunk, cross-checked."""

    signature: Signature
    found: CaseResult
    found_path: Path
    shrunk_path: Path
    example: int  # generated examples run when it was first seen
    seconds: float
    shrunk: CaseResult | None = None  # the smallest failing case of this signature so far
    failures: int = 0
    localisation: localise_mod.Localisation | None = None
    reference_verdict: str | None = None
    second_verdict: str | None = None
    history: history_mod.HistoryFinding | None = None  # its fresh-rank confirmation (None: not confirmed)
    chain: list[CaseResult] = field(default_factory=list)  # each smaller-so-far failure while shrinking

    @property
    def history_dependent(self) -> bool:
        return self.history is not None and self.history.history_dependent

    @property
    def disagreement(self) -> bool:
        """'harness disagreement': the shrunk case fails on the reference or the second implementation."""
        return any(v not in (None, "pass", "unsupported") for v in (self.reference_verdict, self.second_verdict))


@dataclass
class FuzzOutcome:
    """What a property-based run did and found."""

    impl: str
    profile: str
    seed: int
    examples: int = 0  # generated examples run (the search)
    runs: int = 0  # every case run, shrinking included
    found_at_run: int = 0  # `runs` when the first failure was found (shrink_runs counts from there)
    failures: int = 0  # failing runs, shrinking included
    seconds: float = 0.0
    first_failure_example: int | None = None
    first_failure_s: float | None = None
    found: CaseResult | None = None
    found_path: Path | None = None
    shrunk: CaseResult | None = None
    shrunk_path: Path | None = None
    localisation: localise_mod.Localisation | None = None
    reference_verdict: str | None = None  # the shrunk case on the reference implementation
    second_verdict: str | None = None  # the shrunk case on SECOND_IMPL ("unsupported" when it cannot run it)
    bugs: list[Bug] = field(default_factory=list)  # every distinct failure (signature), in the order found
    refused: int = 0  # shrinking candidates that failed on the warm ranks only (not on fresh ones)
    confirmations: int = 0  # fresh-rank confirmation runs
    stop: str = ""
    verdicts: Counter = field(default_factory=Counter)
    worst_pass_ratio: dict[str, float] = field(default_factory=dict)  # dtype -> worst ratio of a passing case
    worst_pass_tensor: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> tensor -> worst ratio

    @property
    def passed(self) -> bool:
        return self.found is None

    @property
    def disagreement(self) -> bool:
        """The (first) shrunk failure fails on the reference or the second implementation too."""
        return bool(self.bugs) and self.bugs[0].disagreement

    def rate_per_min(self) -> float:
        return 60.0 * self.runs / self.seconds if self.seconds > 0 else 0.0


class _Stop(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Ends the hypothesis run (budget spent, or the harness itself broke); not a case failure."""

    def __init__(self, reason: str, error: BaseException | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


def slug(impl: str) -> str:
    """An implementation name as a file-name part."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in impl)


def failure_note(r: CaseResult, what: str, lines: list[str]) -> str:
    return "\n".join([f"{what}: {r.verdict}: {r.case.summary()}", r.detail, *lines])


def save_failure(r: CaseResult, path: Path, note: str, *, impl_version: str = "unknown", backend: str = "gloo",
                 extra: dict | None = None) -> Path:
    """Atomic write of a failing case with its recorded result (plus `extra` keys, e.g. localisation)."""
    rec = result_record(r, impl_version, backend)
    rec.update(extra or {})
    return case_mod.save(r.case, path, result=rec, note=note)


def impl_info(impl: str, allow_import: bool) -> tuple[Capabilities, str]:
    """The implementation's declared capabilities and version (defaults when it cannot be resolved
    here: its cases then fail-stop in the ranks, which report why)."""
    try:
        from harness.impls import registry

        obj = registry.resolve(impl, allow_import=allow_import)
        return obj.capabilities, str(getattr(obj, "version", "unknown"))
    except (ImportError, HarnessError):
        return Capabilities(), "unknown"


def fuzz(
    impl: str,
    pool: RankPool | None = None,
    *,
    profile: str = "ci",
    max_examples: int | None = None,
    time_budget_s: float | None = None,
    shrink_budget_s: float | None = None,
    seed: int | None = None,
    caps: Capabilities | None = None,
    save_dir: str | Path = "ring-harness-failures",
    allow_import: bool = False,
    strategy: st.SearchStrategy[Case] | None = None,
    run: Callable[[Case], CaseResult] | None = None,
    progress: Callable[[FuzzOutcome, str], None] | None = None,
    localise: bool = True,
    impl_version: str = "unknown",
    backend: str = "gloo",
    confirm: bool = True,
) -> FuzzOutcome:
    """Search for a failing case of `impl`, shrink it, save it; see the module docstring.

    `run` replaces `run_case` on `pool` (tests); `progress(outcome, phase)` is called after every run.
    `confirm`: confirm failures on fresh ranks (needs a pool that records its history; not with `run`).
    """
    prof = PROFILES[profile]
    n_examples = prof.max_examples if max_examples is None else max_examples
    budget = prof.time_budget_s if time_budget_s is None else time_budget_s
    shrink_budget = prof.shrink_budget_s if shrink_budget_s is None else shrink_budget_s
    shrink_runs = prof.shrink_runs if shrink_budget_s is None else None  # seconds given: seconds rule
    shrink_wall = shrink_budget * (SHRINK_SAFETY if shrink_runs is not None else 1.0)
    if seed is None:
        seed = 0 if prof.derandomize else random.SystemRandom().randrange(2**32)
    out = FuzzOutcome(impl=impl, profile=profile, seed=seed)
    if n_examples <= 0 or budget <= 0:
        out.stop = "no examples requested"
        return out
    confirming = confirm and run is None and history_mod.recorded_history(pool) is not None
    if run is None:
        if pool is None:
            raise ValueError("fuzz needs a rank pool or a `run` function")

        def run(c: Case) -> CaseResult:
            return run_case(c, pool, impl, allow_import=allow_import)

    if strategy is None:
        size = pool.size if pool is not None else 8
        strategy = strategies.cases(caps, impl=impl, pool_size=size, max_world=size, sizes=prof.sizes)
    save_dir = Path(save_dir)
    start = time.monotonic()
    shrink_end = [float("inf")]
    bugs: dict[Signature, Bug] = {}
    fresh = (history_mod.FreshRanks(backend=backend, placement=getattr(pool, "placement", None))
             if confirming else None)
    raised: dict[str, CaseResult] = {}  # case key -> the failure its first failing run raised

    fresh_of: dict[str, CaseResult] = {}  # case key -> its confirming run on fresh ranks (what is saved)

    def confirmed(r: CaseResult, minimise: bool) -> history_mod.HistoryFinding:
        found = history_mod.confirm(pool, r, impl, allow_import=allow_import, minimise=minimise, fresh=fresh)
        out.confirmations += 1 + found.trials
        if found.confirmed:
            fresh_of[r.case.key()] = found.fresh
        return found

    def confirmed_minimal(bug: Bug, minimal: CaseResult | None) -> CaseResult:
        """The smallest of the bug's failures that fails the same way alone on fresh ranks (as recorded
        there): hypothesis's minimal example, else back through the smaller-so-far ones (each refused
        counts in `out.refused`); the found failure was confirmed before shrinking."""
        cands: dict[str, CaseResult] = {}
        for x in [minimal, *reversed(bug.chain)]:
            if x is not None:
                cands.setdefault(x.case.key(), x)
        for x in list(cands.values())[:MAX_SHRUNK_CONFIRMATIONS]:
            if x.case.key() == bug.found.case.key():
                break
            if x.case.key() in fresh_of or confirmed(x, minimise=False).confirmed:
                return fresh_of[x.case.key()]
            out.refused += 1
        return bug.found

    def note_pass(c: Case, r: CaseResult) -> None:
        worst = max((x for x in (r.worst(t) for t in TENSORS) if x is not None), default=0.0)
        out.worst_pass_ratio[c.dtype] = max(out.worst_pass_ratio.get(c.dtype, 0.0), worst)
        per = out.worst_pass_tensor.setdefault(c.dtype, {})
        for t in TENSORS:
            if r.worst(t) is not None:
                per[t] = max(per.get(t, 0.0), r.worst(t))

    def note_failure(c: Case, r: CaseResult) -> None:
        out.failures += 1
        sig = Signature.of(r)
        r = fresh_of.get(c.key(), r)  # a confirmed failure is recorded as its fresh run (replays bit for bit)
        bug = bugs.get(sig)
        if bug is None:  # a new failure: confirmed on fresh ranks, saved at once, before any shrinking
            stem = f"{slug(impl)}-{r.verdict}-{c.key()}"
            first = not bugs
            what = "found by property-based search" if first else f"another failure ({sig.label()}) found"
            # the first failure is confirmed now (it decides how the run goes on); one found while shrinking
            # is confirmed when the run ends (_confirm_later), so the shrink budget is hypothesis's
            found = confirmed(r, minimise=True) if fresh is not None and first else None
            r = found.reproducer if found is not None and found.confirmed else r
            lines = [f"signature: {sig.label()}"] + ([found.evidence()] if found is not None else [])
            if found is not None and found.sequence is not None:
                path = history_mod.save_sequence(
                    found, save_dir / f"{stem}-found-sequence.yaml", impl_version=impl_version, backend=backend,
                    note=f"{what} (profile {profile}, seed {seed}, example {out.examples}); shrunk version: "
                         f"{stem}-shrunk-sequence.yaml")
                shrunk_path = save_dir / f"{stem}-shrunk-sequence.yaml"
            else:
                if found is not None and found.history_dependent:
                    lines.append(f"NOT A REPRODUCER on fresh ranks: {found.note}")
                path = save_failure(r, save_dir / f"{stem}-found.yaml", failure_note(
                    r, f"{what} (profile {profile}, seed {seed}, example {out.examples}); shrunk version: "
                       f"{stem}-shrunk.yaml", lines), impl_version=impl_version, backend=backend)
                shrunk_path = save_dir / f"{stem}-shrunk.yaml"
            bug = bugs[sig] = Bug(sig, r, path, shrunk_path, out.examples, out.seconds, history=found)
            out.bugs.append(bug)
            if first:
                out.found, out.first_failure_example, out.first_failure_s = r, out.examples, out.seconds
                out.found_path, out.shrunk_path = bug.found_path, bug.shrunk_path
                shrink_end[0] = time.monotonic() + shrink_wall
                out.found_at_run = out.runs
        elif bug.history_dependent:
            pass  # shrunk as a sequence on fresh ranks (_finish), not by hypothesis on warm ranks
        elif case_size(c) <= case_size((bug.shrunk or bug.found).case):  # no larger than the best so far
            bug.shrunk = r
            bug.chain.append(r)
            save_failure(r, bug.shrunk_path, failure_note(r, "shrinking (best so far)", [f"signature: {sig.label()}"]),
                         impl_version=impl_version, backend=backend)
        bug.failures += 1

    def test(c: Case) -> None:
        now = time.monotonic()
        if out.found is None and now - start > budget:
            raise _Stop("time budget")
        if out.found is not None and now > shrink_end[0]:
            raise _Stop(f"shrink budget ({shrink_wall:.0f} s)")
        if out.found is not None and shrink_runs is not None and out.runs - out.found_at_run >= shrink_runs:
            raise _Stop(f"shrink budget ({shrink_runs} runs)")
        if c.key() in raised:  # a re-run (hypothesis replays its examples): the same answer, not a new run
            raise_failure(raised[c.key()])
        try:
            r = run(c)
        except Exception as e:  # the harness broke, not the implementation: do not shrink it
            raise _Stop("harness error", e) from e
        out.runs += 1
        out.verdicts[r.verdict] += 1
        out.seconds = time.monotonic() - start
        if out.found is None:
            out.examples += 1
        if r.passed:
            note_pass(c, r)
        else:
            note_failure(c, r)
        if progress is not None:
            progress(out, "search" if out.found is None else "shrink")
        if not r.passed:
            bug = bugs[Signature.of(r)]
            if bug.history_dependent:
                if bug is out.bugs[0]:
                    raise _Stop("history-dependent: shrunk as a sequence on fresh ranks")
                return  # another bug's shrinking goes on; this one is shrunk as a sequence
            # one exception type per signature: hypothesis shrinks each on its own. A case raises what it
            # raised the first time (its fresh run's failure when confirmed): a warm re-run may fail
            # differently, by what ran before it, and hypothesis needs one answer per example
            raise_failure(raised.setdefault(c.key(), fresh_of.get(c.key(), r)))

    hyp = settings(max_examples=n_examples, derandomize=prof.derandomize, database=None, deadline=None,
                   phases=(Phase.explicit, Phase.generate, Phase.shrink), report_multiple_bugs=True,
                   suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, print_blob=False)
    wrapped = hypothesis_seed(seed)(hyp(given(strategy)(test)))
    minimal: dict[Signature, CaseResult] = {}
    try:
        _run_hypothesis(wrapped, out, minimal, n_examples)
        out.seconds = time.monotonic() - start
        for bug in out.bugs:
            if fresh is not None and bug.history is None:
                _confirm_later(bug, confirmed(bug.found, minimise=True), impl_version, backend)
            if bug.history_dependent:
                bug.shrunk = bug.history.reproducer
                _finish_sequence(out, bug, fresh, shrink_budget, impl_version, backend, allow_import)
                continue
            m = minimal.get(bug.signature)
            if fresh is not None:
                bug.shrunk = confirmed_minimal(bug, m)
            else:
                bug.shrunk = m or bug.shrunk or bug.found
            _finish(out, bug, pool if localise else None, impl_version, backend, allow_import)
    finally:
        if fresh is not None:
            fresh.close()
    if out.bugs:
        # the headline is the smallest shrunk failure: hypothesis shrinks the smallest first, so when the shrink
        # budget ends it, the first one found may still be large (stable sort: ties keep the order found)
        out.bugs.sort(key=lambda b: case_size((b.shrunk or b.found).case))
        first = out.bugs[0]
        out.found, out.found_path = first.found, first.found_path
        out.shrunk, out.localisation = first.shrunk, first.localisation
        out.reference_verdict, out.second_verdict = first.reference_verdict, first.second_verdict
        out.shrunk_path = first.shrunk_path
    return out


def _run_hypothesis(wrapped: Callable[[], None], out: FuzzOutcome, minimal: dict[Signature, CaseResult],
                    n_examples: int) -> None:
    """Run the hypothesis test; its minimal failing example per signature goes into `minimal`."""
    try:
        wrapped()
        out.stop = "budget spent: no failure" if out.examples >= n_examples else "search space exhausted"
    except Flaky:  # before the group: hypothesis's FlakyFailure is an exception group too
        out.stop = "flaky: a failing case did not fail again when re-run"
    except CaseFailed as e:  # hypothesis re-raises the minimal example's failure last
        minimal[Signature.of(e.result)] = e.result
        out.stop = "shrunk"
    except ExceptionGroupType as group:  # one minimal example per distinct failure
        _, rest = group.split(CaseFailed)
        if rest is not None:
            raise rest from None
        for e in _leaves(group):
            minimal[Signature.of(e.result)] = e.result
        out.stop = "shrunk"
    except _Stop as e:
        if e.error is not None:
            raise e.error from None
        out.stop = e.reason


TENSORS = ("out", "lse", "dq", "dk", "dv")


def _leaves(group: ExceptionGroupType) -> list[CaseFailed]:
    out = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, ExceptionGroupType) else [e])
    return out


def cross_check(case: Case, impl: str, pool: RankPool) -> tuple[str | None, str | None]:
    """(verdict on the reference, verdict on SECOND_IMPL) of a failing case, skipping the implementation
    itself; "unsupported" when SECOND_IMPL cannot run it here (e.g. an NCCL pool)."""
    ref = run_case(case, pool, "reference").verdict if impl != "reference" else None
    second = None
    if impl != SECOND_IMPL:
        r = run_case(case, pool, SECOND_IMPL)
        second = "unsupported" if r.verdict == "fail-stop" and "unsupported here" in r.detail else r.verdict
    return ref, second


def _finish(out: FuzzOutcome, bug: Bug, pool: RankPool | None, impl_version: str, backend: str,
            allow_import: bool) -> None:
    """Localise a bug's minimal failure, cross-check it on the reference and the second implementation,
    and write its final shrunk file."""
    r = bug.shrunk
    bug.localisation = localise_mod.localise(r, pool)
    extra = {"localisation": localise_mod.summary(bug.localisation), "signature": bug.signature.label()}
    lines = [f"signature: {bug.signature.label()}"]
    if pool is not None:
        bug.reference_verdict, bug.second_verdict = cross_check(r.case, r.impl, pool)
        extra.update(reference_verdict=bug.reference_verdict, second_verdict=bug.second_verdict,
                     harness_disagreement=bug.disagreement)
        if bug.disagreement:
            lines.append(f"HARNESS DISAGREEMENT: the shrunk case also fails on the reference ({bug.reference_verdict})"
                         f" or on {SECOND_IMPL} ({bug.second_verdict}): suspect the oracle or the tolerance")
    note = failure_note(r, f"shrunk from {bug.found_path.name} ({bug.failures} failing runs of this signature, "
                           f"{out.runs} runs, stop: {out.stop})",
                        lines + [f"where: {f}" for f in bug.localisation.findings])
    bug.shrunk_path = save_failure(r, bug.shrunk_path, note, impl_version=impl_version, backend=backend, extra=extra)
    if bug is out.bugs[0]:
        out.shrunk_path = bug.shrunk_path


def _finish_sequence(out: FuzzOutcome, bug: Bug, fresh: history_mod.FreshRanks, shrink_budget: float,
                     impl_version: str, backend: str, allow_import: bool) -> None:
    """A history-dependent bug: shrink its sequence on fresh ranks, cross-check it (the same sequence on
    the reference and on SECOND_IMPL, fresh ranks) and write its `-shrunk-sequence.yaml`."""
    found = bug.history
    if found.sequence is None:  # no sequence reproduces it: nothing replayable to shrink
        bug.localisation = localise_mod.localise(bug.shrunk, None)
        bug.shrunk_path = bug.found_path
        return
    history_mod.shrink_sequence(found, fresh, budget_s=shrink_budget, allow_import=allow_import)
    r = bug.shrunk = found.reproducer
    bug.localisation = localise_mod.localise(r, None)  # no probes: a re-run would not be in the sequence's place
    ref = fresh.run(found.sequence, lambda s: "reference" if s.case.impl == r.impl else s.case.impl) \
        if r.impl != "reference" else None
    bug.reference_verdict = None if ref is None else str(ref.verdict)
    if r.impl != SECOND_IMPL:
        second = fresh.run(found.sequence, lambda s: SECOND_IMPL if s.case.impl == r.impl else s.case.impl)
        unsupported = second is not None and second.verdict == "fail-stop" and "unsupported here" in second.detail
        bug.second_verdict = None if second is None else "unsupported" if unsupported else str(second.verdict)
    lines = [f"signature: {bug.signature.label()}"]
    if bug.disagreement:
        lines.append(f"HARNESS DISAGREEMENT: the shrunk sequence also fails on the reference ({bug.reference_verdict})"
                     f" or on {SECOND_IMPL} ({bug.second_verdict}): suspect the oracle or the tolerance")
    note = "\n".join([f"shrunk as a sequence from {bug.found_path.name} ({found.shrink_tries} candidates, each run as "
                      f"the whole sequence on fresh ranks; {out.runs} runs, stop: {out.stop})", *lines])
    bug.shrunk_path = history_mod.save_sequence(found, bug.shrunk_path, impl_version=impl_version, backend=backend,
                                                note=note)


def _confirm_later(bug: Bug, found: history_mod.HistoryFinding, impl_version: str, backend: str) -> None:
    """A failure found while another was shrunk, confirmed on fresh ranks when the run ends: its found file
    is rewritten with the fresh run, or replaced by its sequence when it is history-dependent."""
    bug.history = found
    if found.sequence is not None:
        old = bug.found_path
        stem = old.name[: -len("-found.yaml")]
        bug.found_path = history_mod.save_sequence(found, old.with_name(f"{stem}-found-sequence.yaml"),
                                                   impl_version=impl_version, backend=backend,
                                                   note=f"found while shrinking another failure; shrunk version: "
                                                        f"{stem}-shrunk-sequence.yaml")
        old.unlink(missing_ok=True)  # neither it nor hypothesis's best-so-far on warm ranks is a reproducer
        bug.shrunk_path.unlink(missing_ok=True)
        bug.shrunk_path = old.with_name(f"{stem}-shrunk-sequence.yaml")
        return
    r = found.reproducer
    lines = [f"signature: {bug.signature.label()}", found.evidence()]
    if found.history_dependent:
        lines.append(f"NOT A REPRODUCER on fresh ranks: {found.note}")
    bug.found = r
    save_failure(r, bug.found_path, failure_note(r, "found while shrinking another failure", lines),
                 impl_version=impl_version, backend=backend)
