"""Failures that depend on what ran before (issue #19): confirm a failure on fresh ranks, and when
it does not reproduce there, find the shortest sequence of earlier runs that makes it reproduce.

Some bugs show only on a later call in the same process: a gradient buffer cached across calls and
not zeroed (ring-flash-attn 22f0e1d), a stale value a previous step left in a buffer, a communicator
reused with leftover state. The persistent rank pool finds them, and exactly there a single case
stops being a reproducer: replayed on fresh ranks it passes.

So every failure the harness saves is first confirmed (`confirm`): its case runs alone on fresh
ranks (a pool of its own, started for the purpose) and must fail the same way (the same failure
signature: verdict, failing tensors or leak, error class). The saved file then records that fresh
run, so it replays bit for bit (a warm run's numbers may carry state from earlier cases even when
its failure does not depend on it). One that does not fail that way is *history-dependent*. The pool
records what its ranks ran since their last start (`RankPool.history`); the history up to the
failing run, replayed in order on fresh ranks, must reproduce the failure (same signature), and is
minimised by delta debugging (the immediately preceding run first, then the nearest run of the same
case, then longer and longer suffixes, then ddmin within the one that reproduces), under a trial and
time budget. The result is a `CaseSequence` (harness.case_sequence: a list of cases, pure data) that
`replay` runs in order on fresh ranks. `shrink_sequence` then shrinks the failing case (and every
earlier run of the same case, changed the same way) as single cases are shrunk, judging each
candidate as a whole sequence on fresh ranks, so shrinking never swaps a history bug for another
case.

Costs: nothing for a passing case; for a saved failure one fresh start (a pool of the case's size)
and one run, plus the minimisation's trials when it is history-dependent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness import case_sequence
from harness.case import Case
from harness.case_sequence import CaseSequence, Step
from harness.errors import HarnessError
from harness.judging.verdicts import failure_signature
from harness.result import CaseResult, Verdict
from harness.search.signature import Signature

if TYPE_CHECKING:
    from harness.ranks.backend import Placement
    from harness.ranks.protocol import Pool

MAX_TRIALS = 16  # sequence runs on fresh ranks while looking for the shortest reproducing sequence
BUDGET_S = 60.0
COMPLETED = (Verdict.PASS, Verdict.SILENT_CORRUPTION, Verdict.DIVERGED)


def same_run(a: CaseResult, b: CaseResult) -> bool:
    """The same outcome: verdict and failure signature, and for a completed run identical output
    hashes."""
    if failure_signature(a) != failure_signature(b):
        return False
    return str(a.verdict) not in COMPLETED or a.hashes == b.hashes


def same_failure(got: CaseResult | None, want: CaseResult) -> bool:
    """`got` fails the way `want` does (the same failure signature: the same bug)."""
    return got is not None and not got.passed and failure_signature(got) == failure_signature(want)


def outcome(r: CaseResult) -> str:
    """'pass', or the verdict with what failed: 'silent-corruption (dk, dv)'."""
    sig = failure_signature(r)
    what = [p for p in sig[1:] if not p.startswith("faults=")]
    return f"{sig[0]} ({', '.join(what)})" if what else sig[0]


def recorded_history(pool: Pool) -> list | None:
    """What the pool's ranks ran since their last start (`harness.ranks.pool.Ran`), or None when the
    pool keeps no history (torchrun's ranks cannot be restarted either)."""
    h = getattr(pool, "history", None)
    return None if h is None else list(h)


def forget_baseline(case: Case, impl: str) -> None:
    """Drop the cached fault-free run of a faulted case (harness.runner), so its next run computes
    it on the ranks at hand, as a fresh `ring-harness replay` process does (a cached one may come
    from ranks with another history)."""
    from harness.runner import _BASELINES

    if case.faults:
        _BASELINES.pop((impl, case.replace(faults=()).key()), None)


class FreshRanks:
    """Runs sequences, each on ranks started afresh: a pool of its own (`pool=None`, closed with
    this object) or a given pool that is restarted before every sequence."""

    def __init__(
        self, pool: Pool | None = None, backend: str = "gloo", placement: Placement | None = None
    ) -> None:
        self._own = pool is None
        self.pool = pool
        self.backend = backend
        self.placement = placement  # an own pool's device and staging (None: the environment's)
        self.runs = 0

    def __enter__(self) -> FreshRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._own and self.pool is not None:
            self.pool.close()
            self.pool = None

    def _restart(self, size: int) -> Pool:
        if self.pool is None:
            from harness.ranks.pool import RankPool

            self.pool = RankPool(size, backend=self.backend, placement=self.placement)
        start = getattr(self.pool, "start", None)
        if start is None:
            raise HarnessError(
                "these ranks cannot be restarted (torchrun): a sequence needs fresh ranks"
            )
        # own pool: exactly what it needs
        if self.pool.size < size or (self._own and self.pool.size != size):
            self.pool.size = size
            start()
        # an empty history: nothing ran since the last start
        elif getattr(self.pool, "history", None):
            start()
        return self.pool

    def run(
        self,
        seq: CaseSequence,
        impls: Callable[[Step], str] | None = None,
        allow_import: Callable[[str], bool] | None = None,
    ) -> CaseResult | None:
        """Run every member in order on fresh ranks; the judged result of the last one (None when an
        earlier member hung or killed a rank: the ranks restarted, the sequence is broken).
        `impls(step)` names the implementation of a member (default: the member's own);
        `allow_import(name)` says whether a module path may be imported (default: never)."""
        from harness.runner import _BASELINES, baseline_for, needs_whole_world, run_case

        pool = self._restart(seq.pool_size)
        self.runs += 1
        last = seq.steps[-1]
        last_name = impls(last) if impls else last.case.impl
        # a faulted case is judged against its fault-free run (runner.baseline_for): the one in the
        # sequence (as it ran in the history), else one run just before it, on these ranks (as a
        # fresh replay does)
        plain = last.case.replace(faults=()) if last.case.faults else None
        if plain is not None:
            _BASELINES.pop((last_name, plain.key()), None)
        for step in seq.steps[:-1]:
            name = impls(step) if impls else step.case.impl
            imp = bool(allow_import and allow_import(name))
            if plain is not None and step.case == plain and name == last_name and not step.leak:
                _BASELINES.pop((last_name, plain.key()), None)
                baseline_for(last.case, pool, last_name, imp)
                continue
            reply = pool.collect(
                pool.submit(
                    step.case,
                    name,
                    allow_import=imp,
                    leak=step.leak,
                    whole_world=needs_whole_world(name),
                )
            )
            if reply.hung or reply.dead:
                return None
        return run_case(
            last.case,
            pool,
            last_name,
            allow_import=bool(allow_import and allow_import(last_name)),
            leak=last.leak,
        )


@dataclass
class HistoryFinding:
    """What confirming one failure on fresh ranks found."""

    result: CaseResult  # the failure, on warm ranks
    leak: bool = True  # whether its run included the leak run
    fresh: CaseResult | None = None  # the same case alone on fresh ranks (None: not confirmed)
    earlier: int = 0  # runs the ranks had made since their last start before the failing one
    # the shortest sequence found that reproduces it on fresh ranks
    sequence: CaseSequence | None = None
    seq_result: CaseResult | None = None  # its last case's result there
    trials: int = 0  # sequence runs on fresh ranks
    seconds: float = 0.0
    note: str = ""  # why it could not be confirmed or no sequence was found
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
        """The result a saved file must record (a run on fresh ranks where there is one): the
        sequence's last run, else the case's fresh run when it confirmed the failure, else the
        failure itself."""
        if self.sequence is not None and self.seq_result is not None:
            return self.seq_result
        return self.fresh if self.confirmed else self.result

    def evidence(self) -> str:
        """The evidence in words: 'fresh ranks: pass; after 44 earlier cases on the same ranks:
        ...'."""
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
        """What the check prints about it (indented like the report's details)."""
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
    """Index of the failing run in the history (the last run of its case, implementation and leak
    flag)."""
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
    """Confirm the failing result `r` (just run on `pool`, with the leak run when `leak`) on fresh
    ranks; when it does not reproduce there, find and minimise the sequence of the pool's earlier
    runs that makes it reproduce (see the module docstring). `fresh`: where to run (default: a pool
    of its own)."""
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
        trials = [0]
        deadline = t0 + budget_s

        def reproduces(sub: list[Step]) -> CaseResult | None:
            if trials[0] >= max_trials or time.monotonic() > deadline:
                return None
            trials[0] += 1
            got = fr.run(CaseSequence((*sub, last)), allow_import=allowed)
            return got if same_failure(got, r) else None

        best, best_r = _first_reproducing(prefix, last, reproduces)
        if best is None:
            spent = trials[0] >= max_trials or time.monotonic() > deadline
            found.note = (
                "the trial budget ran out first"
                if spent
                else f"not even all {len(prefix)} earlier runs since the ranks started: a "
                "race, or state "
                "from before the history's oldest run"
            )
        else:
            best, best_r = _ddmin(best, best_r, reproduces)
            found.sequence, found.seq_result = CaseSequence((*best, last)), best_r
        found.trials = trials[0]
    finally:
        if own:
            fr.close()
        found.seconds = time.monotonic() - t0
    return found


def _first_reproducing(
    prefix: list[Step], last: Step, reproduces: Callable[[list[Step]], CaseResult | None]
) -> tuple[list[Step] | None, CaseResult | None]:
    """The first candidate prefix that reproduces: the immediately preceding run, the nearest
    earlier run of the same case, then suffixes of 2, 4, 8, ... runs, then all of them."""
    tried: set[tuple[int, int]] = set()
    # (start, stop) ranges of the prefix; (-1, j): the single run j
    cands: list[tuple[int, int]] = []
    n = len(prefix)
    if n:
        cands.append((n - 1, n))
        same = [j for j in range(n - 2, -1, -1) if prefix[j].case == last.case]
        if same:
            cands.append((-1, same[0]))
        k = 2
        while k < n:
            cands.append((n - k, n))
            k *= 2
        cands.append((0, n))
    for a, b in cands:
        if (a, b) in tried:
            continue
        tried.add((a, b))
        sub = [prefix[b]] if a == -1 else prefix[a:b]
        got = reproduces(sub)
        if got is not None:
            return sub, got
    return None, None


def _ddmin(
    items: list[Step], result: CaseResult, reproduces: Callable[[list[Step]], CaseResult | None]
) -> tuple[list[Step], CaseResult]:
    """Delta debugging (Zeller's ddmin) of the earlier runs: a 1-minimal list (within the budget)
    that still reproduces; the empty list is known not to (the case alone passed on fresh ranks)."""
    n = 2
    while len(items) >= 2:
        size = math.ceil(len(items) / n)
        chunks = [items[k : k + size] for k in range(0, len(items), size)]
        reduced = False
        for sub in chunks + (
            [[x for j, c in enumerate(chunks) if j != i for x in c] for i in range(len(chunks))]
            if len(chunks) > 2
            else []
        ):
            if not sub or len(sub) == len(items):
                continue
            got = reproduces(sub)
            if got is not None:
                items, result, reduced = sub, got, True
                n = 2 if len(sub) <= size else max(n - 1, 2)
                break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items, result


def shrink_sequence(
    found: HistoryFinding,
    fr: FreshRanks | None = None,
    *,
    backend: str = "gloo",
    budget_s: float = 60.0,
    max_tries: int = 60,
    allow_import: bool = False,
) -> HistoryFinding:
    """Shrink a history-dependent failure's sequence: the failing case is shrunk as a single case is
    (harness.search.shrink), every earlier run of the same case changed with it, and each candidate
    is judged as the whole sequence on fresh ranks (same failure signature). Updates `found`."""
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
    """Write a history-dependent failure's sequence, its last case's result recorded, with a note
    that says why it is a sequence."""
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
    """Run a loaded sequence on `pool`, restarted first (fresh ranks). `impl` replaces the
    implementation of every member that names `swap` (default: the last member's), e.g. the
    reference on a mutant's sequence; other members run under their own (built-in)
    implementations."""
    target = swap or seq.last.impl

    def name(step: Step) -> str:
        return impl if impl is not None and step.case.impl == target else step.case.impl

    return FreshRanks(pool).run(seq, name, lambda n: allow_import and n == (impl or target))
