"""The property-based search as an object: a `Search` holds one run's state, one method per step.

Hypothesis draws a case and calls `test_case`. The case runs, and its result is recorded. A pass
updates the worst ratios. A failure is a new bug, confirmed and saved at once, or a smaller one of a
known bug. When hypothesis stops, the run's `ExitReason` is recorded and each bug is finished:
confirmed, localised, cross-checked and saved. docs/check.md says why the steps come in this order.
Hypothesis's `ConjectureRunner` is the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from harness.case import Case
from harness.judging.run_record import record_of
from harness.ranks.pool import RankPool
from harness.result import CaseResult
from harness.search import failures
from harness.search import history as history_mod
from harness.search.explore import explore
from harness.search.fresh_ranks import FreshRanks
from harness.search.outcome import Bug, ExitReason, FuzzOutcome
from harness.search.shrink import case_size
from harness.search.signature import CaseFailed, Signature, raise_failure

try:
    ExceptionGroupType = BaseExceptionGroup  # noqa: F821 - a builtin from Python 3.11
# Python 3.10: the backport that hypothesis itself depends on.
except NameError:
    from exceptiongroup import BaseExceptionGroup as ExceptionGroupType

# Fresh-rank confirmations of shrunk candidates, newest first.
MAX_SHRUNK_CONFIRMATIONS = 6
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")


@dataclass(frozen=True)
class Budget:
    """A run's limits, resolved from its profile and the caller's overrides."""

    examples: int  # generated examples
    seconds: float  # the search's wall clock (inf: no limit)
    shrink_s: float  # seconds of shrinking, also a history-dependent sequence's
    shrink_runs: int | None  # runs after the first failure (None: the seconds rule only)
    shrink_wall_s: float  # shrinking stops after this many seconds whatever the runs
    derandomize: bool


class _Stop(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Ends the hypothesis run: the budget is spent, or the harness broke. Not a case failure."""

    def __init__(
        self,
        reason: ExitReason | None,
        error: BaseException | None = None,
        **budget: float | int | None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error
        self.budget = budget


class Search:
    """One property-based run of an implementation: search, shrink, confirm, finish.

    `execute` runs one case. `outcome` collects the counts and the bugs as the run goes.
    With `confirming`, failures are confirmed on fresh ranks (harness.search.history).
    """

    def __init__(
        self,
        outcome: FuzzOutcome,
        execute: Callable[[Case], CaseResult],
        strategy: st.SearchStrategy[Case],
        budget: Budget,
        *,
        pool: RankPool | None,
        save_dir: Path,
        allow_import: bool,
        progress: Callable[[FuzzOutcome, str], None] | None,
        localise: bool,
        impl_version: str,
        backend: str,
        confirming: bool,
        explore_examples: int = 0,
    ) -> None:
        self.outcome = outcome
        self.explore_examples = explore_examples
        self.execute = execute
        self.strategy = strategy
        self.budget = budget
        self.pool = pool
        self.save_dir = save_dir
        self.allow_import = allow_import
        self.progress = progress
        self.localise = localise
        self.impl_version = impl_version
        self.backend = backend
        self.confirming = confirming
        self.start = 0.0
        self.shrink_end = float("inf")  # set when the first failure is found
        self.fresh: FreshRanks | None = None
        self.bugs: dict[Signature, Bug] = {}
        # case key -> the failure its first failing run raised
        self.raised: dict[str, CaseResult] = {}
        # case key -> its confirming run on fresh ranks (what is saved)
        self.fresh_of: dict[str, CaseResult] = {}
        # hypothesis's minimal failing example per signature
        self.minimal: dict[Signature, CaseResult] = {}

    def run(self) -> FuzzOutcome:
        """Search and shrink, then finish every bug. The fresh ranks close whatever happens."""
        self.start = time.monotonic()
        if self.confirming:
            placement = getattr(self.pool, "placement", None)
            self.fresh = FreshRanks(backend=self.backend, placement=placement)
        test = self._hypothesis_test()
        try:
            self._run_hypothesis(test)
            if self.outcome.bugs and self.explore_examples:
                self.outcome.seen += explore(
                    self.strategy,
                    self.execute,
                    seed=self.outcome.seed,
                    examples=self.explore_examples,
                    derandomize=self.budget.derandomize,
                )
            self.outcome.seconds = time.monotonic() - self.start
            for bug in self.outcome.bugs:
                self._finish_bug(bug)
        finally:
            if self.fresh is not None:
                self.fresh.close()
        self.outcome.set_headline()
        return self.outcome

    def _hypothesis_test(self) -> Callable[[], None]:
        """`test_case` as a hypothesis test: its settings, the run's seed, no example database."""
        hyp = settings(
            max_examples=self.budget.examples,
            derandomize=self.budget.derandomize,
            database=None,
            deadline=None,
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
            report_multiple_bugs=True,
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            print_blob=False,
        )

        def test(c: Case) -> None:
            self.test_case(c)

        return hypothesis_seed(self.outcome.seed)(hyp(given(self.strategy)(test)))

    def _run_hypothesis(self, test: Callable[[], None]) -> None:
        """Run the hypothesis test and record its ExitReason.

        Its minimal failing example per signature goes into `self.minimal`.
        """
        out = self.outcome
        try:
            test()
            if out.examples >= self.budget.examples:
                out.end(ExitReason.MAX_EXAMPLES)
            else:
                out.end(ExitReason.EXHAUSTED)
        # Before the group: hypothesis's FlakyFailure is an exception group too.
        except Flaky:
            out.end(ExitReason.FLAKY)
        # Hypothesis re-raises the minimal example's failure last.
        except CaseFailed as e:
            self.minimal[Signature.of(e.result)] = e.result
            out.end(ExitReason.SHRUNK)
        # One minimal example per distinct failure.
        except ExceptionGroupType as group:
            _, rest = group.split(CaseFailed)
            if rest is not None:
                raise rest from None
            for e in _leaves(group):
                self.minimal[Signature.of(e.result)] = e.result
            out.end(ExitReason.SHRUNK)
        except _Stop as e:
            if e.error is not None:
                raise e.error from None
            out.end(e.reason, **e.budget)

    def test_case(self, c: Case) -> None:
        """One example: check the budget, run the case, record it and report progress.

        A failure is raised for hypothesis to shrink.
        """
        self._check_budget(time.monotonic())
        # a re-run (hypothesis replays its examples): the same answer, not a new run
        if c.key() in self.raised:
            raise_failure(self.raised[c.key()])
        try:
            r = self.execute(c)
        # The harness broke, not the implementation: do not shrink it.
        except Exception as e:
            raise _Stop(None, e) from e
        self._record(c, r)
        if self.progress is not None:
            self.progress(self.outcome, "search" if self.outcome.found is None else "shrink")
        if not r.passed:
            self._raise_failure(c, r)

    def _check_budget(self, now: float) -> None:
        """Stop the run when its search or shrink budget is spent."""
        out, budget = self.outcome, self.budget
        if out.found is None and now - self.start > budget.seconds:
            raise _Stop(ExitReason.TIME_BUDGET)
        if out.found is not None and now > self.shrink_end:
            raise _Stop(ExitReason.SHRINK_SECONDS, seconds=budget.shrink_wall_s)
        runs = budget.shrink_runs
        if out.found is not None and runs is not None and out.runs - out.found_at_run >= runs:
            raise _Stop(ExitReason.SHRINK_RUNS, runs=runs)

    def _record(self, c: Case, r: CaseResult) -> None:
        """Count a run, then note it as a pass or a failure."""
        out = self.outcome
        out.runs += 1
        out.verdicts[r.verdict] += 1
        out.seen.append(record_of(r, "property"))
        out.seconds = time.monotonic() - self.start
        if out.found is None:
            out.examples += 1
        if r.passed:
            self._note_pass(c, r)
        else:
            self._note_failure(c, r)

    def _note_pass(self, c: Case, r: CaseResult) -> None:
        out = self.outcome
        worst = max((x for x in (r.worst(t) for t in TENSORS) if x is not None), default=0.0)
        out.worst_pass_ratio[c.dtype] = max(out.worst_pass_ratio.get(c.dtype, 0.0), worst)
        per = out.worst_pass_tensor.setdefault(c.dtype, {})
        for t in TENSORS:
            if r.worst(t) is not None:
                per[t] = max(per.get(t, 0.0), r.worst(t))

    def _note_failure(self, c: Case, r: CaseResult) -> None:
        """Note a failure: a new bug, or one of a known bug.

        A history-dependent bug is shrunk as a sequence on fresh ranks when the run ends, not by
        hypothesis on the warm ranks.
        """
        self.outcome.failures += 1
        sig = Signature.of(r)
        # a confirmed failure is recorded as its fresh run (replays bit for bit)
        r = self.fresh_of.get(c.key(), r)
        bug = self.bugs.get(sig)
        if bug is None:
            bug = self._new_bug(c, r, sig)
        elif not bug.history_dependent and case_size(c) <= bug.best_size():
            self._shrunk_so_far(bug, r)
        bug.failures += 1

    def _new_bug(self, c: Case, r: CaseResult, sig: Signature) -> Bug:
        """A new failure: confirmed on fresh ranks, saved at once, before any shrinking."""
        out = self.outcome
        stem = f"{failures.slug(out.impl)}-{r.verdict}-{c.key()}"
        first = not self.bugs
        what = "found by property-based search"
        if not first:
            what = f"another failure ({sig.label()}) found"
        # The first failure is confirmed now: it decides how the run goes on. One found while
        # shrinking is confirmed when the run ends (confirm_later): the shrink budget stays
        # hypothesis's.
        found = None
        if self.fresh is not None and first:
            found = self._confirm(r, minimise=True)
            if found.confirmed:
                r = found.reproducer
        path, shrunk_path = failures.save_found(
            r,
            sig,
            found,
            save_dir=self.save_dir,
            stem=stem,
            what=f"{what} (profile {out.profile}, seed {out.seed}, example {out.examples})",
            impl_version=self.impl_version,
            backend=self.backend,
        )
        bug = Bug(sig, r, path, shrunk_path, out.examples, out.seconds, history=found)
        self.bugs[sig] = bug
        out.bugs.append(bug)
        if first:
            out.found, out.first_failure_example, out.first_failure_s = r, out.examples, out.seconds
            out.found_path, out.shrunk_path = bug.found_path, bug.shrunk_path
            self.shrink_end = time.monotonic() + self.budget.shrink_wall_s
            out.found_at_run = out.runs
        return bug

    def _shrunk_so_far(self, bug: Bug, r: CaseResult) -> None:
        """A smaller failure of a known bug: its best so far, saved over the last."""
        bug.shrunk = r
        bug.chain.append(r)
        lines = [f"signature: {bug.signature.label()}"]
        note = failures.failure_note(r, "shrinking (best so far)", lines)
        failures.save_failure(
            r, bug.shrunk_path, note, impl_version=self.impl_version, backend=self.backend
        )

    def _raise_failure(self, c: Case, r: CaseResult) -> None:
        """Hand a failure to hypothesis, or stop when the first bug is history-dependent."""
        bug = self.bugs[Signature.of(r)]
        if bug.history_dependent:
            if bug is self.outcome.bugs[0]:
                raise _Stop(ExitReason.HISTORY_DEPENDENT)
            # Another bug's shrinking goes on. This one is shrunk as a sequence.
            return
        # One exception type per signature: hypothesis shrinks each on its own. A case raises what
        # it raised the first time, its fresh run's failure when confirmed. A warm re-run may fail
        # differently, by what ran before it, and hypothesis needs one answer per example.
        raise_failure(self.raised.setdefault(c.key(), self.fresh_of.get(c.key(), r)))

    def _confirm(self, r: CaseResult, minimise: bool) -> history_mod.HistoryFinding:
        """Re-run a failure alone on fresh ranks (harness.search.history.confirm)."""
        found = history_mod.confirm(
            self.pool,
            r,
            self.outcome.impl,
            allow_import=self.allow_import,
            minimise=minimise,
            fresh=self.fresh,
        )
        self.outcome.confirmations += 1 + found.trials
        if found.confirmed:
            self.fresh_of[r.case.key()] = found.fresh
        return found

    def _confirmed_minimal(self, bug: Bug, minimal: CaseResult | None) -> CaseResult:
        """The smallest of the bug's failures that fails the same way alone on fresh ranks.

        It is returned as recorded there. Hypothesis's minimal example is tried first, then the
        smaller-so-far ones, back from the newest. Each refused one counts in `outcome.refused`. The
        found failure was confirmed before shrinking.
        """
        cands: dict[str, CaseResult] = {}
        for x in [minimal, *reversed(bug.chain)]:
            if x is not None:
                cands.setdefault(x.case.key(), x)
        for x in list(cands.values())[:MAX_SHRUNK_CONFIRMATIONS]:
            if x.case.key() == bug.found.case.key():
                break
            if x.case.key() in self.fresh_of or self._confirm(x, minimise=False).confirmed:
                return self.fresh_of[x.case.key()]
            self.outcome.refused += 1
        return bug.found

    def _finish_bug(self, bug: Bug) -> None:
        """Confirm a bug found while shrinking another, pick its minimal case, save its file."""
        files = {"impl_version": self.impl_version, "backend": self.backend}
        if self.fresh is not None and bug.history is None:
            failures.confirm_later(bug, self._confirm(bug.found, minimise=True), **files)
        if bug.history_dependent:
            bug.shrunk = bug.history.reproducer
            failures.finish_sequence(
                self.outcome,
                bug,
                self.fresh,
                self.budget.shrink_s,
                allow_import=self.allow_import,
                **files,
            )
            return
        m = self.minimal.get(bug.signature)
        if self.fresh is not None:
            bug.shrunk = self._confirmed_minimal(bug, m)
        else:
            bug.shrunk = m or bug.shrunk or bug.found
        failures.finish(self.outcome, bug, self.pool if self.localise else None, **files)


def _leaves(group: ExceptionGroupType) -> list[CaseFailed]:
    out = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, ExceptionGroupType) else [e])
    return out
