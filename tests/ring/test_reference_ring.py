"""The reference ring against the float64 oracle on real gloo ranks: every case of the default
battery (each mask, layout, dtype, uneven split, GQA/MQA, W in 1, 2, 3, 4, 8, a subgroup ring),
plus a sweep of masks x layouts x dtypes at W=3 with arbitrary per-rank lengths."""

from __future__ import annotations

import itertools

import pytest

from harness.calls import needs_backward
from harness.case import make_case
from harness.checks.report import details
from harness.runner import run_case
from harness.search.battery import default_battery

BATTERY = default_battery(4)
SWEEP = [
    make_case(
        world_size=3,
        seq_lens=(9, 2, 14),
        layout=layout,
        mask=mask,
        dtype=dtype,
        heads_q=4,
        heads_kv=1,
        head_dim=8,
        seed=i,
    )
    for i, (layout, mask, dtype) in enumerate(
        itertools.product(
            ("contiguous", "zigzag", "striped"),
            (
                {"kind": "causal"},
                {"kind": "window", "window": 3},
                {"kind": "document", "doc_starts": [0, 8, 11, 20], "causal": True},
            ),
            ("fp32", "fp16", "bf16"),
        )
    )
]


@pytest.mark.parametrize("case", BATTERY + SWEEP, ids=lambda c: c.summary().replace(" ", "-"))
def test_reference_passes(ring_pool, case):
    r = run_case(case, ring_pool)
    assert r.verdict == "pass", "\n".join(details(r))
    # no_grad, inference_mode: out and lse judged, no gradient to leak through
    if not needs_backward(case.call):
        assert r.leak is None and {c.tensor for c in r.checks} == {"out", "lse"}
        return
    if case.mask.kind == "none":
        assert r.leak is None  # nothing is hidden: no leak check to run
    else:
        assert r.leak is not None and r.leak.passed and r.leak.queries, (
            "the leak check must run on a masked case"
        )
    assert {c.tensor for c in r.checks} >= {"out", "dq", "dk", "dv"}


def test_zero_length_shard_works(ring_pool):
    from harness.runner import run_case

    r = run_case(make_case(world_size=3, seq_lens=(4, 0, 6), mask={"kind": "causal"}), ring_pool)
    assert r.verdict == "pass", r.detail  # the reference supports zero-length shards (README)
    assert {c.rank for c in r.checks} == {0, 1, 2}
