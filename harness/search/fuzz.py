"""The property-based run: hypothesis (in the parent only) draws Cases, each example is one
`run_case` on the persistent rank pool, and a failure is saved, shrunk and saved again.

Saving order is what makes a failure impossible to lose: the first failing case is written
atomically (`...-found.yaml`) the moment it is seen, before shrinking starts; every smaller
failure hypothesis finds while shrinking overwrites `...-shrunk.yaml` (atomic rename), and the
final minimal case is written there with its localisation. Hypothesis's example database is not
used: the YAML file is the record.
"""

from __future__ import annotations

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
from harness.search import strategies


@dataclass(frozen=True)
class Profile:
    """A hypothesis budget: examples, seconds of search, seconds of shrinking, fixed or random seed."""

    name: str
    max_examples: int
    time_budget_s: float
    shrink_budget_s: float
    derandomize: bool


PROFILES = {
    # the default `check`: a fixed, reproducible search that fits in about a minute on 2 cores
    "ci": Profile("ci", max_examples=300, time_budget_s=45.0, shrink_budget_s=60.0, derandomize=True),
    # long random search for scheduled runs
    "nightly": Profile("nightly", max_examples=50_000, time_budget_s=3600.0, shrink_budget_s=600.0, derandomize=False),
}


@dataclass
class FuzzOutcome:
    """What a property-based run did and found."""

    impl: str
    profile: str
    seed: int
    examples: int = 0  # generated examples run (the search)
    runs: int = 0  # every case run, shrinking included
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
    stop: str = ""
    verdicts: Counter = field(default_factory=Counter)
    worst_pass_ratio: dict[str, float] = field(default_factory=dict)  # dtype -> worst ratio of a passing case
    worst_pass_tensor: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> tensor -> worst ratio

    @property
    def passed(self) -> bool:
        return self.found is None

    def rate_per_min(self) -> float:
        return 60.0 * self.runs / self.seconds if self.seconds > 0 else 0.0


class _CaseFailed(Exception):
    """Raised inside the hypothesis test for a failing case, so hypothesis shrinks it."""

    def __init__(self, result: CaseResult) -> None:
        super().__init__(f"{result.verdict}: {result.case.summary()}")
        self.result = result


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
) -> FuzzOutcome:
    """Search for a failing case of `impl`, shrink it, save it; see the module docstring.

    `run` replaces `run_case` on `pool` (tests); `progress(outcome, phase)` is called after every run.
    """
    prof = PROFILES[profile]
    n_examples = prof.max_examples if max_examples is None else max_examples
    budget = prof.time_budget_s if time_budget_s is None else time_budget_s
    shrink_budget = prof.shrink_budget_s if shrink_budget_s is None else shrink_budget_s
    if seed is None:
        seed = 0 if prof.derandomize else random.SystemRandom().randrange(2**32)
    out = FuzzOutcome(impl=impl, profile=profile, seed=seed)
    if n_examples <= 0 or budget <= 0:
        out.stop = "no examples requested"
        return out
    if run is None:
        if pool is None:
            raise ValueError("fuzz needs a rank pool or a `run` function")

        def run(c: Case) -> CaseResult:
            return run_case(c, pool, impl, allow_import=allow_import)

    if strategy is None:
        size = pool.size if pool is not None else 8
        strategy = strategies.cases(caps, impl=impl, pool_size=size, max_world=size)
    save_dir = Path(save_dir)
    start = time.monotonic()
    shrink_end = [float("inf")]
    best: list[CaseResult] = []

    def test(c: Case) -> None:
        now = time.monotonic()
        if out.found is None and now - start > budget:
            raise _Stop("time budget")
        if out.found is not None and now > shrink_end[0]:
            raise _Stop("shrink budget")
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
            worst = max((x for x in (r.worst(t) for t in ("out", "lse", "dq", "dk", "dv")) if x is not None),
                        default=0.0)
            out.worst_pass_ratio[c.dtype] = max(out.worst_pass_ratio.get(c.dtype, 0.0), worst)
            per = out.worst_pass_tensor.setdefault(c.dtype, {})
            for t in ("out", "lse", "dq", "dk", "dv"):
                if r.worst(t) is not None:
                    per[t] = max(per.get(t, 0.0), r.worst(t))
        else:
            out.failures += 1
            if out.found is None:
                out.found, out.first_failure_example, out.first_failure_s = r, out.examples, out.seconds
                stem = f"{slug(impl)}-{r.verdict}-{c.key()}"
                out.found_path = save_failure(
                    r, save_dir / f"{stem}-found.yaml",
                    failure_note(r, f"found by property-based search (profile {profile}, seed {seed}, "
                                    f"example {out.examples}); shrunk version: {stem}-shrunk.yaml", []),
                    impl_version=impl_version, backend=backend)
                out.shrunk_path = save_dir / f"{stem}-shrunk.yaml"
                shrink_end[0] = time.monotonic() + shrink_budget
            else:
                save_failure(r, out.shrunk_path, failure_note(r, "shrinking (best so far)", []),
                             impl_version=impl_version, backend=backend)
            best.append(r)
        if progress is not None:
            progress(out, "search" if out.found is None else "shrink")
        if not r.passed:
            raise _CaseFailed(r)

    hyp = settings(max_examples=n_examples, derandomize=prof.derandomize, database=None, deadline=None,
                   phases=(Phase.explicit, Phase.generate, Phase.shrink), report_multiple_bugs=False,
                   suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, print_blob=False)
    wrapped = hypothesis_seed(seed)(hyp(given(strategy)(test)))
    try:
        wrapped()
        out.stop = "budget spent: no failure" if out.examples >= n_examples else "search space exhausted"
    except _CaseFailed as e:
        best.append(e.result)  # hypothesis re-raises the minimal example's failure last
        out.stop = "shrunk"
    except _Stop as e:
        if e.error is not None:
            raise e.error from None
        out.stop = e.reason
    except Flaky:
        out.stop = "flaky: a failing case did not fail again when re-run"
    out.seconds = time.monotonic() - start
    if best:
        out.shrunk = best[-1]
        _finish(out, pool if localise else None, impl_version, backend, allow_import)
    return out


def _finish(out: FuzzOutcome, pool: RankPool | None, impl_version: str, backend: str, allow_import: bool) -> None:
    """Localise the minimal failure, check it on the reference, and write the final shrunk file."""
    r = out.shrunk
    out.localisation = localise_mod.localise(r, pool) if out.localisation is None else out.localisation
    extra = {"localisation": localise_mod.summary(out.localisation)}
    if pool is not None and r.impl != "reference":
        out.reference_verdict = run_case(r.case, pool, "reference").verdict
        extra["reference_verdict"] = out.reference_verdict
    found = out.found_path.name if out.found_path else "?"
    note = failure_note(r, f"shrunk from {found} ({out.failures} failing runs, {out.runs} runs, stop: {out.stop})",
                        [f"where: {f}" for f in out.localisation.findings])
    out.shrunk_path = save_failure(r, out.shrunk_path, note, impl_version=impl_version, backend=backend, extra=extra)
