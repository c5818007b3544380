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
from one to another. A failure with a new signature is a different bug: it gets its own
`-found.yaml` and `-shrunk.yaml` (FuzzOutcome.bugs); the first one found is the outcome's
`found`/`shrunk`. A shrunk case is run on the reference and on the second independent implementation
(SECOND_IMPL); if either fails it too, it is reported as a harness disagreement (suspect the oracle
or the tolerance) rather than a bug of the implementation.

Fresh-rank confirmations (issue #19, harness.search.history) are interleaved with the search: a new
failure is re-run alone on fresh ranks before its `-found.yaml` is written. One that does not
reproduce there is history-dependent: the run stops, the sequence of earlier cases that makes it
reproduce on fresh ranks is minimised and saved (`-found-sequence.yaml`), then shrunk as a sequence
(`-shrunk-sequence.yaml`). A failure that did reproduce fresh is shrunk by hypothesis on the warm
ranks, and its minimal case is confirmed the same way; one that fails only on the warm ranks is
refused and the shrinker steps back through the smaller-so-far failures to the newest that fails
alone on fresh ranks (at most MAX_SHRUNK_CONFIRMATIONS tries, else the found case), so shrinking
never swaps a bug for a history effect. Every saved single case records its fresh run.

This module is the entry: the profiles and `fuzz`. The run itself is a `Search`, in
harness.search.engine with MAX_SHRUNK_CONFIRMATIONS. The outcome and its `ExitReason` are in
harness.search.outcome. The failure files and SECOND_IMPL are in harness.search.failures.
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
    """A hypothesis budget: examples, seconds of search, runs and seconds of shrinking, fixed or
    random seed, and how large the drawn cases may be (strategies.SIZES). A profile whose bounds are
    counts (examples, shrink_runs) runs the same cases on any machine; its seconds are a safety
    stop, reported when hit."""

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

    `run` replaces `run_case` on `pool` (tests); `progress(outcome, phase)` is called after every
    run. `confirm`: confirm failures on fresh ranks (needs a pool that records its history; not with
    `run`).
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
        size = pool.size if pool is not None else 8
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
    )
    return search.run()


def _budget(
    prof: Profile,
    max_examples: int | None,
    time_budget_s: float | None,
    shrink_budget_s: float | None,
) -> Budget:
    """The profile's budget with the caller's overrides.

    Given seconds of shrinking, the seconds rule applies: no count of runs.
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
