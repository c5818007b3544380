"""The check with the calls, input forms and values a model hands a ring (issue #40): a forward-only
ring passes with every case's out judged, a wrong one fails; each mutant of the class is killed by
the battery and passes it with those dimensions off (`--no-model-calls`). The whole default check of
each mutant with them off runs in the slow tier."""

from __future__ import annotations

import io

import pytest

from harness.checks.check import run_check
from harness.checks.options import CheckOptions
from harness.checks.report import Reporter

NEW_MUTANTS = (
    "no-grad-path-causal-by-rank",
    "q-scaled-in-place",
    "inputs-assumed-contiguous",
    "dout-assumed-contiguous",
    "qk-product-in-input-dtype",
)
FORWARD_ONLY = "tests.helpers.impls:forward_only"


POOL_SIZE = 8  # ranks of the module's `pool` (tests/conftest.py)


def _check(pool, tmp_path, impl: str, **kw):
    opts = dict(impl=impl, repeat=False, save_dir=str(tmp_path))
    return run_check(
        pool, CheckOptions(**{**opts, **kw}).validate(), reporter=Reporter(io.StringIO())
    )


def test_a_forward_only_ring_passes_with_every_out_judged(pool, tmp_path):
    res = _check(pool, tmp_path, FORWARD_ONLY, max_examples=10, scale=False)
    assert res.passed, [f.result.detail for f in res.failures]
    judged = [r for r in res.results if r.case.faults == ()]
    assert judged and all({c.tensor for c in r.checks} == {"out", "lse"} for r in judged)
    assert {r.case.call for r in judged} == {"no-grad", "inference-mode"}


def test_a_wrong_forward_only_ring_fails(pool, tmp_path):
    res = _check(
        pool,
        tmp_path,
        "tests.helpers.impls:forward_only_wrong",
        max_examples=0,
        scale=False,
        growth=False,
        fault_stage=(),
    )
    assert not res.passed
    assert {f.result.case.layout for f in res.failures} <= {"zigzag", "striped"}


@pytest.mark.parametrize("name", NEW_MUTANTS)
def test_each_new_mutant_is_killed_by_the_battery(pool, tmp_path, name):
    battery = dict(max_examples=0, scale=False, growth=False, fault_stage=())
    # the first failure is enough: `off` passing shows every case outside the model calls passes
    on = _check(pool, tmp_path / "on", f"mutant:{name}", maxfail=1, **battery)
    assert not on.passed
    assert all(
        f.result.case.call != "train"
        or f.result.case.inputs != "contiguous"
        or f.result.case.values in ("outliers", "qk-overflow", "sink")
        for f in on.failures
    )
    # that it survives without the model calls: the slow test below, over the whole default check


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW_MUTANTS)
def test_each_new_mutant_passes_the_whole_default_check_without_model_calls(pool, tmp_path, name):
    # what the battery test cannot show: the property stage, the scale and fault stages and the
    # growth check miss each of them too when the new dimensions are off (so the dimensions are what
    # kills them)
    # 60 property-based examples, not the ci profile's 300: every stage runs (~50 s, not ~110 s)
    res = _check(pool, tmp_path, f"mutant:{name}", model_calls=False, max_examples=60)
    assert res.passed, [f.result.detail for f in res.failures]
