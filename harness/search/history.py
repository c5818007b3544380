"""Failures that depend on what ran before: confirm a failure on fresh ranks, or find its sequence.

Some bugs show only on a later call in the same process, such as a gradient buffer cached across
calls and never zeroed. The persistent rank pool finds them, but there a single case stops being a
reproducer. So `confirm` re-runs every failure the harness saves alone on fresh ranks. When it does
not reproduce there, the shortest sequence of earlier runs that makes it reproduce is found and
minimised. docs/check.md has the steps and what they cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness import case_sequence
from harness.case import Case
from harness.case_sequence import CaseSequence, Step
from harness.judging.verdicts import failure_signature
from harness.result import CaseResult, Verdict
from harness.search.fresh_ranks import FreshRanks
from harness.search.sequence_search import ddmin, first_reproducing
from harness.search.signature import Signature

if TYPE_CHECKING:
    from harness.ranks.protocol import Pool

# Sequence runs on fresh ranks while looking for the shortest reproducing sequence.
MAX_TRIALS = 16
BUDGET_S = 60.0
COMPLETED = (Verdict.PASS, Verdict.SILENT_CORRUPTION, Verdict.DIVERGED)


def same_run(a: CaseResult, b: CaseResult) -> bool:
    """The same outcome: verdict and failure signature, and identical output hashes for a completed
    run.
    """
    if failure_signature(a) != failure_signature(b):
        return False
    return str(a.verdict) not in COMPLETED or a.hashes == b.hashes


def same_failure(got: CaseResult | None, want: CaseResult) -> bool:
    """Whether `got` fails the way `want` does: the same failure signature, so the same bug."""
    return got is not None and not got.passed and failure_signature(got) == failure_signature(want)


def outcome(r: CaseResult) -> str:
    """'pass', or the verdict with its cause and tensors: 'silent-corruption (backward: dk, dv)'."""
    sig = failure_signature(r)
    what = ", ".join(p for p in sig[1:] if not p.startswith("faults="))
    tensors = ", ".join(sorted({c.tensor for c in r.failed_checks()}))
    what += f": {tensors}" if what and tensors else ""
    return f"{sig[0]} ({what})" if what else sig[0]


def recorded_history(pool: Pool) -> list | None:
    """What the pool's ranks ran since their last start (`harness.ranks.pool.Ran`).

    None when the pool keeps no history. torchrun's ranks keep none, and cannot be restarted either.
    """
    h = getattr(pool, "history", None)
    return None if h is None else list(h)


def forget_baseline(case: Case, impl: str) -> None:
    """Drop the cached fault-free run of a faulted case (harness.runner).

    Its next run then computes the baseline on the ranks at hand, as a fresh `ring-harness replay`
    process does. A cached baseline may come from ranks with another history.
    """
    from harness.runner import _BASELINES

    if case.faults:
        _BASELINES.pop((impl, case.replace(faults=()).key()), None)


@dataclass
class HistoryFinding:
    """What confirming one failure on fresh ranks found."""

    result: CaseResult  # the failure, on warm ranks
    leak: bool = True  # whether its run included the leak run
    # the same case alone on fresh ranks (None: not confirmed)
    fresh: CaseResult | None = None
    # runs the ranks had made since their last start, before the failing one
    earlier: int = 0
    # the shortest sequence found that reproduces it on fresh ranks
    sequence: CaseSequence | None = None
    seq_result: CaseResult | None = None  # its last case's result there
    trials: int = 0  # sequence runs on fresh ranks
    seconds: float = 0.0
    # why it could not be confirmed, or why no sequence was found
    note: str = ""
    shrink_tries: int = 0

    @property
    def confirmed(self) -> bool:
        """The case alone on fresh ranks fails the same way."""
        return self.fresh is not None and same_failure(self.fresh, self.result)

    @property
    def history_dependent(self) -> bool:
        return self.fresh is not None and not self.confirmed

    @property
    def reproducer(self) -> CaseResult:
        """The result a saved file must record, a run on fresh ranks where there is one.

        It is the sequence's last run, else the case's fresh run when that confirmed the failure,
        else the failure itself.
        """
        if self.sequence is not None and self.seq_result is not None:
            return self.seq_result
        return self.fresh if self.confirmed else self.result

    def evidence(self) -> str:
        """The evidence in words, e.g. 'fresh ranks: pass; after 44 earlier cases on the same ranks:
        ...'.
        """
        if self.fresh is None:
            return f"not confirmed on fresh ranks ({self.note})"
        if self.confirmed:
            if same_run(self.fresh, self.result):
                return "confirmed: reproduces alone on fresh ranks, bit for bit"
            return (
                "confirmed: fails the same way alone on fresh ranks (its numbers there differ "
                "from this run's, "
                "which carried state from earlier cases; the saved file records the fresh run)"
            )
        return (
            f"history-dependent: on fresh ranks this case alone gives {outcome(self.fresh)}; "
            "after "
            f"{self.earlier} earlier case{'s' if self.earlier != 1 else ''} on the same ranks "
            "it gave "
            f"{outcome(self.result)}"
        )

    def lines(self) -> list[str]:
        """What the check prints about it, indented like the report's details."""
        out = [f"        {self.evidence()}"]
        if not self.history_dependent:
            return out
        if self.sequence is None:
            out.append(
                "        no sequence of the earlier cases reproduces it on fresh ranks "
                f"({self.note}): "
                "the saved case is NOT a reproducer"
            )
        else:
            n = len(self.sequence.steps)
            out.append(
                f"        reproducer: a sequence of {n} case{'s' if n != 1 else ''} run in "
                "order on fresh ranks "
                f"(minimised from {self.earlier + 1}, {self.trials} trial runs, "
                f"{self.seconds:.1f} s) gives "
                f"{outcome(self.reproducer)}"
            )
        return out

    def to_dict(self) -> dict:
        return {
            "confirmed": self.confirmed,
            "history_dependent": self.history_dependent,
            "fresh": None if self.fresh is None else str(self.fresh.verdict),
            "earlier": self.earlier,
            "sequence_cases": None if self.sequence is None else len(self.sequence.steps),
            "trials": self.trials,
            "note": self.note,
        }


def _locate(history: list, r: CaseResult, impl: str, leak: bool) -> int | None:
    """The index of the failing run in the history.

    It is the last run of its case, implementation and leak flag.
    """
    for i in range(len(history) - 1, -1, -1):
        ran = history[i]
        if ran.case == r.case and ran.impl == impl and ran.leak == leak:
            return i
    return None


def _steps(history: list) -> list[Step]:
    """History entries as sequence members, each naming the implementation it ran under."""
    return [
        Step(h.case if h.case.impl == h.impl else h.case.replace(impl=h.impl), h.leak)
        for h in history
    ]


class _Trials:
    """Sequence runs on fresh ranks that end with the failing case, within a budget.

    Called with earlier runs, it gives the last case's result when that fails as `want` did, else
    None. Once the budget of runs or of time is spent, it runs nothing and gives None.
    """

    def __init__(
        self,
        fr: FreshRanks,
        last: Step,
        want: CaseResult,
        allowed: Callable[[str], bool],
        max_trials: int,
        deadline: float,
    ) -> None:
        self.fr, self.last, self.want, self.allowed = fr, last, want, allowed
        self.max_trials, self.deadline = max_trials, deadline
        self.count = 0

    def spent(self) -> bool:
        """Whether the runs or the time are used up."""
        return self.count >= self.max_trials or time.monotonic() > self.deadline

    def __call__(self, sub: list[Step]) -> CaseResult | None:
        if self.spent():
            return None
        self.count += 1
        got = self.fr.run(CaseSequence((*sub, self.last)), allow_import=self.allowed)
        return got if same_failure(got, self.want) else None


def confirm(
    pool: Pool,
    r: CaseResult,
    impl: str | None = None,
    *,
    leak: bool = True,
    allow_import: bool = False,
    minimise: bool = True,
    max_trials: int = MAX_TRIALS,
    budget_s: float = BUDGET_S,
    fresh: FreshRanks | None = None,
) -> HistoryFinding:
    """Confirm the failing result `r` on fresh ranks, or find the sequence that reproduces it.

    `r` was just run on `pool`, with the leak run when `leak`. When it does not reproduce alone on
    fresh ranks, the pool's earlier runs that make it reproduce are found and minimised.
    docs/check.md has the steps. `fresh` says where to run, by default in a pool of its own.
    """
    impl = impl or r.impl
    t0 = time.monotonic()
    found = HistoryFinding(result=r, leak=leak)
    history = recorded_history(pool)
    if history is None:
        found.note = "these ranks keep no history and cannot be restarted (torchrun)"
        return found
    i = _locate(history, r, impl, leak)
    prefix = _steps(history[:i]) if i is not None else []
    found.earlier = len(prefix)
    last = Step(r.case if r.case.impl == impl else r.case.replace(impl=impl), leak)
    own = fresh is None
    fr = fresh or FreshRanks(
        backend=getattr(pool, "backend", "gloo"), placement=getattr(pool, "placement", None)
    )

    def allowed(name: str) -> bool:
        return allow_import and name == impl

    try:
        found.fresh = fr.run(CaseSequence((last,)), allow_import=allowed)
        if found.confirmed or not minimise:
            return found
        if i is None:
            found.note = "the failing run is not in the ranks' history"
            return found
        trials = _Trials(fr, last, r, allowed, max_trials, t0 + budget_s)
        best, best_r = first_reproducing(prefix, last, trials)
        if best is None:
            found.note = (
                "the trial budget ran out first"
                if trials.spent()
                else f"not even all {len(prefix)} earlier runs since the ranks started: a "
                "race, or state "
                "from before the history's oldest run"
            )
        else:
            best, best_r = ddmin(best, best_r, trials)
            found.sequence, found.seq_result = CaseSequence((*best, last)), best_r
        found.trials = trials.count
    finally:
        if own:
            fr.close()
        found.seconds = time.monotonic() - t0
    return found


def shrink_sequence(
    found: HistoryFinding,
    fr: FreshRanks | None = None,
    *,
    backend: str = "gloo",
    budget_s: float = 60.0,
    max_tries: int = 60,
    allow_import: bool = False,
) -> HistoryFinding:
    """Shrink a history-dependent failure's sequence, and update `found`.

    The failing case is shrunk as a single case is (harness.search.shrink). Every earlier run of the
    same case changes with it. Each candidate is judged as the whole sequence on fresh ranks, by its
    failure signature.
    """
    from harness.search.shrink import shrink

    if found.sequence is None or found.seq_result is None:
        return found
    seq = found.sequence
    original = seq.last
    impl = found.seq_result.impl
    tried: dict[str, CaseSequence] = {}
    own = fr is None
    fr = fr or FreshRanks(backend=backend)

    def as_sequence(c: Case) -> CaseSequence:
        return CaseSequence(tuple(Step(c, s.leak) if s.case == original else s for s in seq.steps))

    def still_fails(c: Case) -> CaseResult | None:
        cand = as_sequence(c)
        got = fr.run(cand, allow_import=lambda name: allow_import and name == impl)
        if got is None or got.passed or got.verdict == Verdict.INVALID:
            return None
        tried[c.key()] = cand
        return got

    try:
        best, found.shrink_tries = shrink(
            found.seq_result,
            still_fails,
            budget_s=budget_s,
            max_tries=max_tries,
            signature=Signature.of,
        )
    finally:
        if own:
            fr.close()
    if best is not found.seq_result:
        found.sequence, found.seq_result = tried[best.case.key()], best
    return found


def save_sequence(
    found: HistoryFinding,
    path,
    *,
    impl_version: str = "unknown",
    backend: str = "gloo",
    note: str = "",
    expect: str | None = None,
):
    """Write a history-dependent failure's sequence, with its last case's result recorded.

    A note says why it is a sequence.
    """
    from harness.result import result_record

    assert found.sequence is not None and found.seq_result is not None
    r = found.seq_result
    head = [
        f"{r.verdict}: {found.sequence.summary()}",
        f"history-dependent: {outcome(found.fresh) if found.fresh else '?'} when the last case "
        "runs alone on fresh "
        f"ranks; {outcome(r)} when the cases below run in this order on the same fresh ranks "
        "(`ring-harness replay` does exactly that)",
    ]
    text = "\n".join(head + ([note] if note else []) + ([r.detail] if r.detail else []))
    return case_sequence.save_sequence(
        found.sequence,
        path,
        result=result_record(r, impl_version, backend),
        note=text,
        expect=expect,
    )


def run_file_sequence(
    pool: Pool,
    seq: CaseSequence,
    impl: str | None = None,
    *,
    allow_import: bool = False,
    swap: str | None = None,
) -> CaseResult | None:
    """Run a loaded sequence on `pool`, restarted first, so on fresh ranks.

    `impl` replaces the implementation of every member that names `swap`, by default the last
    member's. An example is the reference on a mutant's sequence. The other members run under their
    own built-in implementations.
    """
    target = swap or seq.last.impl

    def name(step: Step) -> str:
        return impl if impl is not None and step.case.impl == target else step.case.impl

    return FreshRanks(pool).run(seq, name, lambda n: allow_import and n == (impl or target))
