"""Sequences of cases run on ranks started afresh.

A failure that depends on what ran before is reproduced by a sequence of cases. `FreshRanks` runs
each sequence on ranks with no history, and judges the last case. harness.search.history uses it to
confirm failures and to find and shrink their sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from harness.case_sequence import CaseSequence, Step
from harness.errors import HarnessError
from harness.result import CaseResult

if TYPE_CHECKING:
    from harness.ranks.backend import Placement
    from harness.ranks.protocol import Pool


class FreshRanks:
    """Runs sequences, each on ranks started afresh.

    With `pool=None` it uses a pool of its own, closed with this object. A given pool is restarted
    before every sequence.
    """

    def __init__(
        self, pool: Pool | None = None, backend: str = "gloo", placement: Placement | None = None
    ) -> None:
        self._own = pool is None
        self.pool = pool
        self.backend = backend
        # An own pool's device and staging. None: the environment's.
        self.placement = placement
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
        """Run every member in order on fresh ranks, and return the last one's judged result.

        The result is None when an earlier member hung or killed a rank: the ranks restarted, and
        the sequence is broken. `impls(step)` names a member's implementation, by default the
        member's own. `allow_import(name)` says whether a module path may be imported, by default
        never.
        """
        from harness.runner import _BASELINES, baseline_for, run_case, submit

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
            reply = pool.collect(submit(pool, step.case, name, allow_import=imp, leak=step.leak))
            if reply.hung or reply.dead:
                return None
        return run_case(
            last.case,
            pool,
            last_name,
            allow_import=bool(allow_import and allow_import(last_name)),
            leak=last.leak,
        )
