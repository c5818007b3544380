"""Probes of an undeclared mask expression (issue #16): an implementation that silently accepts one
and answers wrong is a finding; one that refuses it in one line is not."""

from __future__ import annotations

from harness.checks.options import CheckOptions
from harness.checks.stages import battery
from harness.impls.capabilities import unsupported
from harness.judging.verdicts import probe_acceptable
from harness.runner import run_case
from tests.helpers.mask_impls import NARROW

BLIND, REFUSING = "tests.helpers.mask_impls:mask_blind", "tests.helpers.mask_impls:refusing"


def _expression_probes():
    _, probes = battery.plan(CheckOptions(impl=BLIND), NARROW)
    return [c for c in probes if "mask:expr" in unsupported(NARROW, c)]


def test_the_battery_probes_an_undeclared_expression():
    probes = _expression_probes()
    assert probes and probes[0].mask.kind == "expr"


POOL_SIZE = 4  # ranks of the module's `pool` (tests/conftest.py)


def test_a_silently_accepted_expression_is_a_finding_a_refusal_is_not(pool):
    c = _expression_probes()[0]
    blind = run_case(c, pool, BLIND, allow_import=True)
    assert blind.verdict == "silent-corruption" and not probe_acceptable(blind)
    refused = run_case(c, pool, REFUSING, allow_import=True)
    assert refused.verdict == "fail-stop" and probe_acceptable(refused)
    assert "unsupported here: mask expr" in str(
        refused.errors
    ) and f"the mask is {c.mask.describe()}" in str(refused.errors)
