"""The scale stage in the default check (issue #29): the three mutants that are right at toy sizes
pass today's battery and growth check (the check as it was, `--no-scale`) and each fails a
scale-stage case; the stage's rows, counts and JSON are reported like the battery's."""

from __future__ import annotations

import io

import pytest

from harness.checks.check import run_check
from harness.checks.options import CheckOptions
from harness.checks.report import Reporter
from harness.checks.summary import outcome_json, verdict_line
from harness.impls.adapters.reference import REFERENCE_CAPABILITIES
from harness.runner import run_case
from harness.search.scale import scale_cases

SCALE_MUTANTS = ("tile-tail-dropped", "positions-in-input-dtype", "head-dim-dispatch-slip")


POOL_SIZE = 8  # ranks of the module's `pool` (tests/conftest.py)


@pytest.mark.parametrize("name", SCALE_MUTANTS)
def test_each_scale_mutant_fails_a_scale_stage_case(pool, name):
    for c in scale_cases(REFERENCE_CAPABILITIES, f"mutant:{name}"):
        r = run_case(c, pool)
        if not r.passed:
            assert r.verdict == "silent-corruption", r.detail
            return
    pytest.fail(f"{name} passed every scale-stage case")


@pytest.mark.slow
@pytest.mark.parametrize("name", SCALE_MUTANTS)
def test_scale_mutants_pass_the_check_without_the_scale_stage(pool, name):
    """Guards the issue's premise (slow: the battery and growth check per mutant, ~40 s each): each
    mutant is exact on what the check ran before the scale stage, so only the new stage (or sizes at
    scale) can kill it."""
    opts = CheckOptions(
        impl=f"mutant:{name}", scale=False, max_examples=30, fault_stage=(), repeat=False
    )
    res = run_check(pool, opts, reporter=Reporter(io.StringIO()))
    assert res.passed and not res.scale_results and len(res.results) > 40 and res.growth.cases, (
        verdict_line(res)
    )


def test_the_stage_is_reported_counted_and_stops_at_a_failure(pool, tmp_path):
    log = io.StringIO()
    opts = CheckOptions(
        impl="mutant:tile-tail-dropped",
        max_examples=0,
        growth=False,
        fault_stage=(),
        repeat=False,
        save_dir=str(tmp_path),
    )
    res = run_check(pool, opts, stop_at_first_failure=True, reporter=Reporter(log))
    text = log.getvalue()
    assert "scale stage: 8 cases at training sizes (kernel tiles 64, 128" in text
    assert res.failures[0].stage == "scale" and not res.passed and len(res.scale_results) == 1
    assert "stopped at scale stage case 1" in res.stopped
    assert "scale stage 1/1 cases" in verdict_line(res)
    assert outcome_json(res)["scale"][0]["verdict"] == "silent-corruption"
    assert set(res.stage_seconds) == {"growth", "battery", "scale"}
    assert list(tmp_path.glob("*.yaml")), "the failing case is saved"
