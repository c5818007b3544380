"""The inference shapes on the rank pool (issue #54): the references pass every serving battery
case, each decode mutant fails a serving case and passes the same tokens as a training case, and a
ring that returns log2 for ln is told the base."""

from __future__ import annotations

import pytest

from harness.case import make_case
from harness.impls.adapters.reference import DECODE_CAPABILITIES
from harness.impls.registry import resolve
from harness.runner import run_case
from harness.search.serving_draws import battery_cases

POOL_SIZE = 4
W = 4
REFERENCES = ("reference-pass-kv", "reference-pass-q", "reference-decode", "reference-decode-a2a")


def _battery(name: str) -> list[dict]:
    return battery_cases(W, resolve(name).capabilities)


@pytest.mark.parametrize("name", REFERENCES)
def test_each_reference_passes_every_serving_battery_case(pool, name):
    cases = _battery(name)
    assert len(cases) >= (
        8 if DECODE_CAPABILITIES.queries <= resolve(name).capabilities.queries else 6
    )
    for i, kw in enumerate(cases):
        c = make_case(world_size=W, seed=70 + i, impl=name, **kw)
        r = run_case(c, pool)
        assert r.passed, (c.summary(), r.verdict, r.detail)


def test_the_pass_kv_ring_passes_a_prefill_with_its_backward(pool):
    req = {"context": [9, 14], "new": [4, 3], "kv": "striped"}
    c = make_case(world_size=W, serving=req, mask={"kind": "causal"}, sinks=(2.0, 3.5))
    r = run_case(c, pool, "reference-pass-kv")
    assert r.passed, r.detail
    assert {"dq", "dk", "dv", "dsinks"} <= {x.tensor for x in r.checks}


KILLS = {
    "decode-lse-log2-merged": dict(context=[13, 6], new=[1, 1], kv="interleaved", interleave=2),
    "decode-lse-returned-log2": dict(context=[13, 6], new=[1, 1], kv="contiguous"),
    "decode-causal-bound-from-local-length": dict(context=[13, 6], new=[3, 2], kv="striped"),
    "decode-empty-share-nan": dict(context=[13, 0], new=[1, 1], kv="interleaved", interleave=4),
    "decode-multi-token-causal-offset": dict(context=[13, 6], new=[4, 2], kv="contiguous"),
    "decode-context-chunk-local-length": dict(context=[13, 6], new=[1, 1], kv="interleaved"),
}


@pytest.mark.parametrize("name", KILLS)
def test_each_decode_mutant_fails_a_serving_case_and_passes_its_tokens_as_training(pool, name):
    c = make_case(
        world_size=W, serving=KILLS[name], mask={"kind": "causal"}, call="inference-mode", seed=3
    )
    bad = run_case(c, pool, f"mutant:{name}")
    assert not bad.passed, bad.detail
    assert run_case(c, pool, "reference-decode").passed
    plain = make_case(world_size=W, total_len=c.total_len, mask={"kind": "causal"}, call="no-grad")
    assert run_case(plain, pool, f"mutant:{name}").passed
    if name == "decode-lse-returned-log2":
        assert "lse in the wrong base: the ranks returned log2 where ln was declared" in bad.detail
