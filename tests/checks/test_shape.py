"""`check --shape`: the spec, the plan at exactly that shape (what the implementation does not
declare is refused or left out), the estimate and the up-front refusal (one line, exit 2), and a
small shape judged end to end."""

from __future__ import annotations

import io

import pytest

from harness.checks import shape as shape_mod
from harness.checks.options import CheckOptions
from harness.checks.shape import Rates, Shape, parse_shape, plan
from harness.commands.cli import main
from harness.context import Capabilities
from harness.errors import HarnessError
from harness.impls.adapters.reference import REFERENCE_CAPABILITIES


def test_the_spec_reads_every_field_with_defaults():
    assert parse_shape("b1,hq32,hkv8,d128,L8192,W8") == Shape(1, 32, 8, 128, 8192, 8)
    assert parse_shape("hq4,d64,L1024,W4") == Shape(1, 4, 4, 64, 1024, 4)
    assert parse_shape("B2, h16, D80, l300, w3") == Shape(2, 16, 16, 80, 300, 3)
    assert parse_shape("b1,hq32,hkv8,d128,L8192,W8").spec() == "b1,hq32,hkv8,d128,L8192,W8"


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "expected e.g."),
        ("b1,hq32", "missing d, L, W"),
        ("hq32,hkv5,d64,L64,W2", "multiple of hkv"),
        ("hq4,d64,L3,W4", "W <= L"),
        ("hq4,x7,d64,L64,W2", "cannot read 'x7'"),
        ("hq4,hq4,d64,L64,W2", "given twice"),
        ("hq4,d0,L64,W2", "head_dim must be an integer in \\[1, 4096\\]"),
    ],
)
def test_a_bad_spec_is_one_line(spec, words):
    with pytest.raises(HarnessError, match=words) as e:
        parse_shape(spec)
    assert "\n" not in str(e.value) and str(e.value).startswith("--shape")


def test_the_plan_runs_every_declared_layout_mask_dtype_and_the_growth_sizes_up_to_w():
    p = plan(parse_shape("b2,hq8,hkv2,d64,L1000,W8"), REFERENCE_CAPABILITIES)
    assert len(p.basics) == 3 * 4 * 3 and not p.left_out
    assert {
        (c.world_size, c.total_len, c.batch, c.heads_q, c.heads_kv, c.head_dim) for c in p.basics
    } == {(8, 1000, 2, 8, 2, 64)}
    assert p.growth_worlds == (1, 2, 4, 8) and len(p.growth) == 4
    assert {c.mask.kind for c in p.basics} == {"none", "causal", "window", "document"}
    assert p.runs == p.basics + [c for g in p.growth for c in g.values()]
    assert plan(parse_shape("hq4,d64,L96,W3"), REFERENCE_CAPABILITIES).growth_worlds == (1, 2, 3)


def test_what_is_not_declared_is_refused_or_left_out():
    narrow = Capabilities(
        layouts=frozenset({"zigzag"}),
        masks=frozenset({"causal"}),
        dtypes=frozenset({"bf16"}),
        gqa=False,
        world_sizes=(2, 8),
        head_dims=(64, 128),
    )
    p = plan(parse_shape("hq4,d64,L1024,W4"), narrow)
    assert [c.summary().split(" b1")[0] for c in p.basics] == ["W4 zigzag causal bf16"]
    assert any("contiguous none" in x for x in p.left_out)
    assert p.growth_worlds == (2, 4)
    for spec, words in (
        ("hq4,hkv1,d64,L1024,W4", "GQA"),
        ("hq4,d80,L1024,W4", "head_dim 80"),
        ("hq4,d64,L1024,W1", "world size 1"),
    ):
        with pytest.raises(HarnessError, match=words):
            plan(parse_shape(spec), narrow)


SLOW_HOST = Rates(fp32=1e10, fp64=4e9, cores=2)


def test_the_estimate_grows_with_the_work_and_refuses_over_budget():
    small, big = (
        plan(parse_shape(s), REFERENCE_CAPABILITIES)
        for s in ("hq4,d64,L1024,W4", "b1,hq32,hkv8,d128,L8192,W8")
    )
    est_small, est_big = shape_mod.estimate(small, SLOW_HOST), shape_mod.estimate(big, SLOW_HOST)
    assert est_small.seconds < est_big.seconds / 1000
    with pytest.raises(HarnessError, match="over --shape-budget 3600 s") as e:
        shape_mod.refuse_or_accept(big, est_big, 3600.0, None)
    assert "36 basics + 16 growth-check runs would take ~" in str(e.value) and "peak memory" in str(
        e.value
    )
    shape_mod.refuse_or_accept(small, est_small, 3600.0, None)  # accepted


def test_the_issues_shape_is_refused_up_front_with_its_estimate(capsys):
    assert main(["check", "--shape", "b1,hq32,hkv8,d128,L8192,W8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "--shape b1,hq32,hkv8,d128,L8192,W8: 36 basics + 16 growth-check runs" in err[0]
    )


def test_a_small_shape_is_judged_and_the_tile_tail_mutant_fails_there(tmp_path):
    from harness.checks.check import run_check
    from harness.checks.report import Reporter
    from harness.checks.summary import verdict_line
    from harness.ranks.pool import RankPool

    spec = "b1,hq2,hkv1,d32,L130,W2"  # 65 tokens a rank: one past a 64-token tile
    with RankPool(2) as pool:
        log = io.StringIO()
        ok = run_check(
            pool,
            CheckOptions(shape=spec, dtype="bf16", save_dir=str(tmp_path)),
            reporter=Reporter(log),
        )
        bad = run_check(
            pool,
            CheckOptions(
                impl="mutant:tile-tail-dropped",
                shape=spec,
                dtype="bf16",
                growth=False,
                save_dir=str(tmp_path),
                maxfail=1,
            ),
            reporter=Reporter(io.StringIO()),
        )
    assert ok.passed and len(ok.shape_results) == 12 and ok.growth is not None and ok.growth.passed
    assert f"shape {spec}: 12 basics" in log.getvalue() and "estimate here: ~" in log.getvalue()
    assert verdict_line(ok).startswith(
        f"check PASSED (exit 0): every case of reference at shape {spec} passed (16 cases in "
    ) and "growth check 4, at your shape 12" in verdict_line(ok)
    assert (
        not bad.passed
        and bad.failures[0].stage == "shape"
        and "at your shape 1/1 basics" in verdict_line(bad)
    )
