"""The capability matrix and its probes (issue #30): a probe changes exactly one undeclared
feature (one dimension: the mask, the split, the heads, ...) of an otherwise declared case, so
the matrix says what that feature really does; where no battery case isolates a feature it says
'not probed'."""

from __future__ import annotations

from harness.checks.capability_matrix import format_matrix, matrix
from harness.checks.options import CheckOptions
from harness.checks.stages.battery import plan, unprobed
from harness.context import Capabilities
from harness.impls.capabilities import dimension, unsupported
from harness.runner import run_case
from tests.helpers import impls

NO_IDLE = "tests.helpers.impls:no_idle"


def test_a_ring_that_declares_everything_but_idle_ranks_is_probed_on_idle_ranks_alone():
    from harness.ranks.pool import RankPool

    caps = impls.no_idle.capabilities
    cases, probes = plan(CheckOptions(impl=NO_IDLE), caps)
    assert [unsupported(caps, p) for p in probes] == [["idle"]] and not unprobed(
        caps, CheckOptions(impl=NO_IDLE)
    )
    with RankPool(max(p.pool_size for p in probes)) as pool:
        results = [run_case(p, pool, NO_IDLE, allow_import=True) for p in probes]
    line = next(x for x in format_matrix(matrix(caps, [], results)) if x.startswith("idle "))
    assert "1 x works although undeclared" in line, line


def test_every_probe_changes_one_dimension_and_the_rest_is_not_probed():
    narrow = Capabilities(
        layouts=frozenset({"contiguous"}),
        masks=frozenset({"none", "causal"}),
        uneven=False,
        gqa=False,
    )
    _, probes = plan(CheckOptions(), narrow)
    dims = [{dimension(f) for f in unsupported(narrow, p)} for p in probes]
    assert probes and all(len(d) == 1 for d in dims)
    assert {"mask", "split", "heads", "layout:zigzag", "layout:striped"} <= set().union(*dims)
    rows = format_matrix(matrix(narrow, [], [], ["mask:blocks"]))
    assert any(r.startswith("mask:blocks") and "not probed" in r for r in rows)
