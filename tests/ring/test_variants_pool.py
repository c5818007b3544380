"""The variants on the rank pool (issue #53): the reference passes every variant's battery case,
and each variant mutant fails the case that has its variant and passes the plain one."""

from __future__ import annotations

import pytest

from harness.case import make_case
from harness.runner import run_case
from harness.search.variants import battery_cases, sink_values
from ring_impl.masks import MaskSpec

POOL_SIZE = 4
W = 3


@pytest.mark.parametrize("i", range(len(battery_cases(W))))
def test_the_reference_passes_every_variant_battery_case(pool, i):
    kw = battery_cases(W)[i]
    size = {} if "seq_lens" in kw else {"total_len": 6 * W + 3}
    c = make_case(world_size=W, seed=40 + i, **size, **kw)
    r = run_case(c, pool, "reference")
    assert r.passed, (r.verdict, r.detail)
    if c.sinks is not None:
        assert any(x.tensor == "dsinks" for x in r.checks)


BASE = dict(world_size=W, total_len=17, heads_q=4, heads_kv=2, head_dim=16, seed=5)
CAUSAL = MaskSpec("causal")
KILLS = {
    "sink-every-step": dict(sinks=sink_values("above", 4, 17), mask=CAUSAL, layout="zigzag"),
    "sink-forward-only": dict(sinks=sink_values("lse", 4, 17), mask=CAUSAL),
    "softcap-unscaled": dict(softcap=2.0, values="large", mask=CAUSAL),
    "softcap-grad-dropped": dict(softcap=2.0, values="large"),
    "alibi-local-positions": dict(alibi=True, mask=CAUSAL, layout="striped"),
    "value-buffers-sized-by-head-dim": dict(head_dim_v=8),
}


@pytest.mark.parametrize("name", KILLS)
def test_each_variant_mutant_fails_its_variant_and_passes_plain_attention(pool, name):
    with_variant = run_case(make_case(**BASE, **KILLS[name]), pool, f"mutant:{name}")
    assert not with_variant.passed, name
    plain = {k: v for k, v in KILLS[name].items() if k in ("mask", "layout", "values")}
    without = run_case(make_case(**BASE, **plain), pool, f"mutant:{name}")
    assert without.passed, (name, without.verdict, without.detail)
