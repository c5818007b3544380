"""The default check serves any implementation: a ring that declares fewer features gets the battery
adapted to the nearest declared features (never silently thinner), from `check`, the pytest plugin
and torchrun alike (they share `stages.battery.plan`). The plugin's side:
tests/test_pytest_plugin.py."""

from __future__ import annotations

from collections import Counter

from harness.checks.options import CheckOptions
from harness.checks.stages import battery
from harness.impls import registry
from harness.impls.capabilities import adapt, unsupported
from harness.search.battery import battery_pool_size, default_battery

NARROW = "tests.helpers.impls:narrow"


def _plan(impl: str):
    caps = registry.resolve(impl, allow_import=True).capabilities
    return caps, battery.plan(CheckOptions(impl=impl), caps)


def _coverage(cases) -> dict:
    return {
        "worlds": sorted({c.world_size for c in cases}),
        "even": sum(len(set(c.seq_lens)) == 1 for c in cases),
        "uneven": sum(len(set(c.seq_lens)) > 1 for c in cases),
        "subgroup": sum(bool(c.group_offset) for c in cases),
        "masks": Counter(c.mask.kind for c in cases),
        "layouts": Counter(c.layout for c in cases),
        "dtypes": Counter(c.dtype for c in cases),
    }


def test_a_narrow_ring_gets_every_world_size_split_and_a_subgroup():
    caps, (cases, probes) = _plan(NARROW)
    assert all(not unsupported(caps, c) for c in cases)
    cov = _coverage(cases)
    assert cov["worlds"] == [1, 2, 3, 4, 8]
    # one overlapping 0..W-1, one not
    assert cov["even"] >= 5 and cov["uneven"] >= 20 and cov["subgroup"] == 2
    assert set(cov["masks"]) == {"none", "causal"} and set(cov["layouts"]) == {"contiguous"}
    assert set(cov["dtypes"]) == {"fp32", "fp16", "bf16"}
    assert battery_pool_size(cases) == 8
    ref_cases, _ = _plan("reference")[1]
    # adapted, deduplicated: not the 7 cases of the old filter
    assert len(cases) >= 0.8 * len(ref_cases)
    # what it does not declare is still probed: one case per undeclared feature, unadapted
    assert {f for c in probes for f in unsupported(caps, c)} >= {
        "layout:zigzag",
        "layout:striped",
        "mask:window",
        "mask:document",
    }


def test_adapting_keeps_world_size_split_and_values():
    caps = registry.resolve(NARROW, allow_import=True).capabilities
    for c in default_battery(4):
        a = adapt(caps, c)
        assert a is not None and not unsupported(caps, a)
        kept = (a.world_size, tuple(a.seq_lens), a.values, a.seed)
        # an idle rank (undeclared) gets one token; every other rank keeps its length
        assert kept == (c.world_size, tuple(max(1, n) for n in c.seq_lens), c.values, c.seed)
