"""Issue #53's judging: dsinks is judged like dq against each rank's own share, a backward whose
reply lacks dsinks is judged as zeros, a forward-only ring gets only out and lse judged; the rule's
sink terms; and a few cases of the ring-free flash-style second implementation
(scripts/variant_false_alarms.py) pass while its planted sink and ALiBi bugs fail."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from harness.case import make_case
from harness.judging import tolerance
from harness.judging.tensor_checks import check_tensors
from harness.oracle.cache import outputs
from harness.result import TENSORS, CaseResult, Verdict
from ring_impl.layouts import all_positions

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "variant_false_alarms.py"


def _script():
    spec = importlib.util.spec_from_file_location("variant_false_alarms", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CASE = make_case(
    world_size=3,
    seq_lens=(5, 9, 4),
    layout="zigzag",
    mask={"kind": "causal"},
    heads_q=4,
    heads_kv=2,
    head_dim=8,
    head_dim_v=6,
    softcap=10.0,
    alibi=True,
    sinks=(0.0, 2.9, 4.0, 6.5),
    dtype="bf16",
    seed=8,
)


def _shards(case, exact, names=("out", "lse", "dq", "dk", "dv", "dsinks")):
    """Every rank's exact outputs as float32 results."""
    out = {}
    for r, pos in enumerate(all_positions(case.layout, case.seq_lens)):
        t = {
            n: getattr(exact, n).index_select(2 if n == "lse" else 1, pos).float()
            for n in names
            if n != "dsinks"
        }
        if "dsinks" in names:
            t["dsinks"] = exact.dsinks[r].float()
        out[r] = t
    return out


def _dsinks(checks):
    return {c.rank: c for c in checks if c.tensor == "dsinks"}


def test_dsinks_is_judged_summed_over_the_ranks():
    """How rows and heads are split over ranks is the ring's choice; the sum is the gradient."""
    exact, base = outputs(CASE)
    shards = _shards(CASE, exact, ("out", "lse", "dq", "dk", "dv"))
    for r in shards:
        shards[r]["dsinks"] = exact.dsinks[r].float()
    got = _dsinks(check_tensors(CASE, shards, exact, base))
    assert sorted(got) == [0] and got[0].passed and set(got[0].position) == {"head"}
    # Ulysses' split: rank 0 holds the whole gradient, the others none of it
    for r in shards:
        shards[r]["dsinks"] = (exact.dsinks.sum(0) if r == 0 else exact.dsinks[0] * 0).float()
    assert _dsinks(check_tensors(CASE, shards, exact, base))[0].passed
    # a rank that counts another's rows twice does not sum to the gradient
    shards[1]["dsinks"] = exact.dsinks[0].float()
    bad = _dsinks(check_tensors(CASE, shards, exact, base))[0]
    assert not bad.passed and bad.ratio > 1


def test_a_backward_without_dsinks_is_judged_as_zeros_and_a_forward_only_ring_not_at_all():
    exact, base = outputs(CASE)
    shards = _shards(CASE, exact, ("out", "lse", "dq", "dk", "dv"))
    got = _dsinks(check_tensors(CASE, shards, exact, base))
    assert sorted(got) == [0] and not got[0].passed
    assert got[0].error == pytest.approx(float(exact.dsinks.sum(0).abs().max()))
    forward = _shards(CASE, exact, ("out", "lse"))
    checks = check_tensors(CASE, forward, exact, base)
    assert {c.tensor for c in checks} == {"out", "lse"}


def test_a_wrong_or_non_finite_dsinks_fails():
    exact, base = outputs(CASE)
    shards = _shards(CASE, exact)
    shards[2]["dsinks"] = torch.full((4,), float("nan"))
    got = _dsinks(check_tensors(CASE, shards, exact, base))[0]
    assert got.nonfinite == 4 and got.nonfinite_kinds == "NaN" and not got.passed
    shards = _shards(CASE, exact)
    shards[0]["dsinks"] = torch.zeros(3)  # the wrong number of heads
    assert not _dsinks(check_tensors(CASE, shards, exact, base))[0].passed


def test_the_sink_terms_of_the_rule():
    assert tolerance.ROUNDINGS["dsinks"] == {"terms": 2, "D": 4}
    assert tolerance.K_FACTORS["dsinks"] == tolerance.K_FACTORS["dq"] == 3.0
    e32, ubf = torch.finfo(torch.float32).eps, 2.0**-8
    got = tolerance.bound("dsinks", "bf16", 0.0, 0.1, term_scale={"terms": 1.0, "D": 2.0})
    assert got == pytest.approx(ubf * (2 * 1.0 + 4 * 2.0) + 1 * e32 * 2.0)
    # the sink is one more merge: one more float32 step, and one more merge of out
    plain = tolerance.bound("out", "fp32", 0.0, 1.0, world_size=2, term_scale=1.0, block_scale=4.0)
    sink = tolerance.bound(
        "out", "fp32", 0.0, 1.0, world_size=2, term_scale=1.0, block_scale=4.0, sinks=True
    )
    assert sink - plain == pytest.approx(e32 * 1.0 + 2 * e32 / 2 * 4.0)
    # W merges (one is the sink's) err by 2 float32 units of max|v| each in out, seen through D
    scales = {"terms": 1.0, "D": 2.0, "dout": 5.0}
    at_w2 = tolerance.bound("dsinks", "fp32", 0.0, 0.1, world_size=2, term_scale=scales, sinks=True)
    more = tolerance.bound(
        "dsinks", "fp32", 0.0, 0.1, world_size=2, term_scale=scales, block_scale=3.0, sinks=True
    )
    assert more - at_w2 == pytest.approx(2 * 2 * e32 / 2 * 3.0 * 5.0)
    # a cap: P and c err with the scores before it (T_lse), not with the capped lse
    assert tolerance.score_units(4.0, 100.0, None) == 4.0
    assert tolerance.score_units(4.0, 100.0, 0.5) == pytest.approx(4.0 + 100.0 * 5)
    # the saved record's worst ratio per tensor lists dsinks
    exact, base = outputs(CASE)
    res = CaseResult(
        CASE, "x", Verdict.PASS, checks=check_tensors(CASE, _shards(CASE, exact), exact, base)
    )
    assert "dsinks" in TENSORS and "dsinks" in res.to_dict()["worst_ratio"]


def test_the_flash_style_second_implementation_passes_and_its_planted_bugs_fail():
    """Two cases per variant of the false-alarm run (docs/tolerance.md has 2,000 each)."""
    mod = _script()
    worst, failures, counts = mod.run(2, 1, mod.VARIANTS, mod.simulated())
    assert not failures and sum(counts.values()) == 10
    assert 0 < max(worst.values()) < 1
    case = make_case(
        world_size=2,
        total_len=14,
        mask={"kind": "causal"},
        heads_q=2,
        heads_kv=1,
        alibi=True,
        sinks=(4.0, 6.0),
        dtype="fp16",
        seed=2,
    )
    exact, base = outputs(case)
    for mutant, tensor in (("sink-dropped", "out"), ("alibi-local", "out")):
        checks = check_tensors(case, mod.flash_ring(case, False, mutant), exact, base)
        assert any(c.tensor == tensor and not c.passed for c in checks), mutant
