"""`--no-variants` (#53): the check of a ring that declares the attention variants, as it was before
them. No battery case, probe, scale case or drawn case carries a variant, so a variant mutant's
survival under it shows that the variants are what kill it."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings

from harness.checks.options import CheckOptions
from harness.checks.stages import battery, scale
from harness.context import VARIANTS
from harness.impls import registry
from harness.impls.capabilities import without_variants
from harness.search import strategies

CAPS = registry.resolve("reference").capabilities
PLAIN = without_variants(CAPS)


def test_the_battery_and_the_scale_stage_keep_no_variant():
    on, off = CheckOptions(), CheckOptions(variants=False)
    cases, probes = battery.plan(on, CAPS)
    assert any(c.variants for c in cases) and not probes
    cases, probes = battery.plan(off, PLAIN)
    assert cases and not any(c.variants for c in cases + probes)
    assert any(c.variants for c in scale.plan(on, CAPS))
    assert not any(c.variants for c in scale.plan(off, PLAIN))
    assert all(not getattr(PLAIN, v) for v in VARIANTS)
    assert dataclasses.replace(PLAIN, **{v: True for v in VARIANTS}) == CAPS


@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(strategies.cases(PLAIN))
def test_no_drawn_case_carries_a_variant(c):
    assert not c.variants


def test_the_command_line_switch():
    from harness.commands.cli import build_parser

    args = build_parser().parse_args(["check", "--no-variants"])
    assert args.variants is False
