"""`assert_ring_close`: one call for a user's own test, in the spirit of
`torch.testing.assert_close`.

    from harness import assert_ring_close
    assert_ring_close("mypkg.attn:my_ring")                       # the fixed battery, adapted
    assert_ring_close(my_ring)                                    # the same, given the Impl (or run function)
    assert_ring_close("mypkg.attn:my_ring", "cases/my-bug.yaml")   # one saved case
    assert_ring_close("mypkg.attn:my_ring", make_case(world_size=4, total_len=29, mask={"kind": "causal"}))

Runs the case (or the default fixed battery, adapted to the implementation's declared
capabilities, as `ring-harness check` does) on a rank pool (yours, or one opened and closed here)
and raises an AssertionError whose message is the localised report of every failing case: the
verdict and case, the worst error per rank and tensor with its global position, where the errors
concentrate (rank or chunk boundaries, the causal diagonal, one ring step) and, with `save_dir`,
the saved YAML that `ring-harness replay` re-runs. Returns the results when every case passes. No
pytest needed.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness import case as case_mod
from harness.case import Case
from harness.checks import report
from harness.checks.options import CheckOptions
from harness.checks.stages import battery
from harness.diagnose import localise
from harness.errors import HarnessError
from harness.impls import registry
from harness.ranks.pool import RankPool
from harness.result import CaseResult, save_result
from harness.runner import check_memory, run_case


def _cases(
    impl: str,
    case: Case | str | os.PathLike | None,
    world_size: int,
    dtype: str | None,
    allow_import: bool,
) -> list[Case]:

    if case is None:
        caps = registry.resolve(impl, allow_import=allow_import).capabilities
        return battery.plan(CheckOptions(impl=impl, world_size=world_size, dtype=dtype), caps)[0]
    if isinstance(case, Case):
        return [case]
    if isinstance(case, (str, os.PathLike)):
        return [case_mod.load(Path(case))[0]]
    raise HarnessError(
        "assert_ring_close: case must be a Case, a case file path or None, got "
        f"{type(case).__name__}"
    )


def failure_message(results: list[CaseResult], pool, impl: str, saved: dict[int, str]) -> str:
    """The AssertionError's text: per failing case, its row, the details and the localisation."""

    bad = [r for r in results if not r.passed]
    lines = [f"{impl}: {len(bad)} of {len(results)} case(s) failed against float64 attention"]
    for i, r in enumerate(bad):
        lines.append(
            f"{r.verdict}: {r.case.summary()}" + (f" (saved {saved[i]})" if i in saved else "")
        )
        lines += report.details(r)
        if r.checks:
            lines += localise.lines(localise.localise(r, pool, probes=False))
    return "\n".join(lines)


def assert_ring_close(
    impl,
    case: Case | str | os.PathLike | None = None,
    *,
    pool=None,
    world_size: int = 4,
    dtype: str | None = None,
    save_dir: str | None = None,
) -> list[CaseResult]:
    """Assert that `impl` (a built-in name, "package.module:attr", or an Impl or run function
    defined at the top level of an importable module: the ranks import it) matches float64 attention
    on `case` (a Case, a case file, or None: the default battery); see the module docstring. Raises
    AssertionError with the localised report, HarnessError on bad input."""

    # an Impl or a run function: by its module-level name, which the ranks import
    if not isinstance(impl, str):
        impl = registry.module_path_of(impl)
    allow_import = registry.is_module_path(impl)
    # unknown name, missing extra: one clear error
    registry.resolve(impl, allow_import=allow_import)
    cases = _cases(impl, case, world_size, dtype, allow_import)
    for c in cases:
        check_memory(c)  # before any rank starts
    own = pool is None
    if own:
        pool = RankPool(max(c.pool_size for c in cases))
    try:
        results = [run_case(c, pool, impl, allow_import=allow_import) for c in cases]
        if all(r.passed for r in results):
            return results
        saved = {}
        if save_dir:
            for i, r in enumerate([r for r in results if not r.passed]):
                saved[i] = str(save_result(r, save_dir, backend=getattr(pool, "backend", "gloo")))
        raise AssertionError(failure_message(results, pool, impl, saved))
    finally:
        if own:
            pool.close()
