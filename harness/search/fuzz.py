"""The property-based run's entry: the profiles, and `fuzz`.

Hypothesis draws cases in the parent only. Each example is one `run_case` on the persistent rank
pool. A failure is saved at once, then shrunk and saved again. docs/check.md says in which order,
and why. The run itself is a `Search` (harness.search.engine). Its outcome and `ExitReason` are in
harness.search.outcome, and its failure files in harness.search.failures.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from harness.case import Case
from harness.context import Capabilities
from harness.errors import HarnessError
from harness.ranks.pool import RankPool
from harness.result import CaseResult
from harness.runner import run_case
from harness.search import history as history_mod
from harness.search import strategies
from harness.search.engine import Budget, Search
from harness.search.outcome import ExitReason, FuzzOutcome


@dataclass(frozen=True)
class Profile:
    """A hypothesis budget, and how large the drawn cases may be (strategies.SIZES).

    The budget holds examples, seconds of search, runs and seconds of shrinking, and a fixed or
    random seed. A profile whose bounds are counts (examples, shrink_runs) runs the same cases on
    any machine. Its seconds are then a safety stop, reported when hit.
    """

    name: str
    max_examples: int
    time_budget_s: float
    shrink_budget_s: float
    derandomize: bool
    sizes: strategies.Sizes | None = None
    # runs after the first failure (shrinking every failure); None: seconds only
    shrink_runs: int | None = None


# a profile with shrink_runs stops shrinking after this x shrink_budget_s all the same
SHRINK_SAFETY = 5.0

PROFILES = {
    # the default `check`: a fixed, reproducible search, the same 300 cases and the same shrinking
    # (300 runs) whatever the machine's load (no search time budget: a slow machine takes longer
    # rather than testing less; SHRINK_SAFETY x 60 s of shrinking is a safety stop); about a minute
    # on 2 cores for a passing ring
    "ci": Profile(
        "ci",
        max_examples=300,
        time_budget_s=math.inf,
        shrink_budget_s=60.0,
        derandomize=True,
        sizes=strategies.SIZES["ci"],
        shrink_runs=300,
    ),
    # long random search for scheduled runs
    "nightly": Profile(
        "nightly",
        max_examples=50_000,
        time_budget_s=3600.0,
        shrink_budget_s=600.0,
        derandomize=False,
        sizes=strategies.SIZES["nightly"],
    ),
}


def impl_info(impl: str, allow_import: bool) -> tuple[Capabilities, str]:
    """The implementation's declared capabilities and version.

    When the name cannot be resolved here, they are the defaults. Its cases then fail-stop in the
    ranks, which report why.
    """
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
    explore_examples: int = 0,
) -> FuzzOutcome:
    """Search for a failing case of `impl`, shrink it and save it.

    `run` replaces `run_case` on `pool`, for tests. `progress(outcome, phase)` is called after every
    run. With `confirm`, failures are confirmed on fresh ranks. That needs a pool that records its
    history, and does not work with `run`. docs/check.md has the order of saving and shrinking.
    After a failure, `explore_examples` more cases run for the check's shared-feature line
    (harness.search.explore).
    """
    prof = PROFILES[profile]
    budget = _budget(prof, max_examples, time_budget_s, shrink_budget_s)
    if seed is None:
        seed = 0 if prof.derandomize else random.SystemRandom().randrange(2**32)
    out = FuzzOutcome(impl=impl, profile=profile, seed=seed)
    if budget.examples <= 0 or budget.seconds <= 0:
        out.end(ExitReason.NOTHING_REQUESTED)
        return out
    confirming = confirm and run is None and history_mod.recorded_history(pool) is not None
    if run is None:
        if pool is None:
            raise ValueError("fuzz needs a rank pool or a `run` function")

        def run(c: Case) -> CaseResult:
            return run_case(c, pool, impl, allow_import=allow_import)

    if strategy is None:
        size = pool.capacity if pool is not None else 8
        strategy = strategies.cases(
            caps, impl=impl, pool_size=size, max_world=size, sizes=prof.sizes
        )
    search = Search(
        out,
        run,
        strategy,
        budget,
        pool=pool,
        save_dir=Path(save_dir),
        allow_import=allow_import,
        progress=progress,
        localise=localise,
        impl_version=impl_version,
        backend=backend,
        confirming=confirming,
        explore_examples=explore_examples,
    )
    return search.run()


def _budget(
    prof: Profile,
    max_examples: int | None,
    time_budget_s: float | None,
    shrink_budget_s: float | None,
) -> Budget:
    """The profile's budget with the caller's overrides.

    When the caller gives seconds of shrinking, the seconds rule applies, with no count of runs.
    """
    shrink_s = prof.shrink_budget_s if shrink_budget_s is None else shrink_budget_s
    shrink_runs = prof.shrink_runs if shrink_budget_s is None else None
    safety = SHRINK_SAFETY if shrink_runs is not None else 1.0
    return Budget(
        examples=prof.max_examples if max_examples is None else max_examples,
        seconds=prof.time_budget_s if time_budget_s is None else time_budget_s,
        shrink_s=shrink_s,
        shrink_runs=shrink_runs,
        shrink_wall_s=shrink_s * safety,
        derandomize=prof.derandomize,
    )
