"""The growth check: the same global case at W = 1, 2, 4, 8; a correct ring's error does not grow
with W, one that rounds a running result to the input dtype once per ring step does (and fails the
check)."""

from __future__ import annotations

import dataclasses

import pytest

from harness.case import make_case
from harness.checks.options import CheckOptions
from harness.checks.stages import growth
from harness.context import Capabilities
from harness.oracle import cache


def test_plan_follows_the_declared_capabilities():
    worlds, plans = growth.plan(Capabilities(), pool_size=8)
    assert worlds == (1, 2, 4, 8) and len(plans) == 4  # bf16, fp16 x none, causal
    for cases in plans:
        c = cases[1]
        assert {w: cases[w].total_len for w in worlds} == dict.fromkeys(worlds, c.total_len)
        assert len({(x.seed, x.mask, x.dtype, x.head_dim, x.heads_q) for x in cases.values()}) == 1
        assert all(len(set(x.seq_lens)) == 1 for x in cases.values())  # even shards at every W
        assert c.dtype in ("bf16", "fp16")
    narrow = Capabilities(dtypes=frozenset({"fp32"}))
    assert growth.plan(narrow, 8)[1] == []  # rounding to fp32 is exact: nothing to measure
    assert growth.plan(Capabilities(world_sizes=(2, 8)), 4)[0] == (2, 4)
    assert growth.plan(Capabilities(), 8, dtype="bf16")[1][0][1].dtype == "bf16"
    assert growth.plan(Capabilities(head_dims=(8, 64)), 8)[1][0][1].head_dim in (8, 64)
    ulysses = growth.plan(Capabilities(heads_divisible_by_world=True), 8)[1][0]
    # one shape every W divides
    assert all((c.heads_q, c.heads_kv) == (8, 8) for c in ulysses.values())


def test_baseline_is_the_larger_error_of_the_one_and_two_rank_rings():
    assert growth.baseline_sizes((1, 2, 4, 8)) == (1, 2)
    assert growth.baseline_sizes((2, 4)) == (2,)
    assert growth.baseline_sizes((1, 2)) == (1,)


def _gc(rms: dict[int, dict[str, float]]) -> growth.GrowthCase:
    cases = {
        w: make_case(world_size=w, total_len=16, dtype="bf16", head_dim=8, seed=1) for w in rms
    }
    gc = growth.GrowthCase(label="t", cases=cases, rms=rms)
    growth._figures(gc)
    return gc


def test_growth_figure_and_limit():
    flat = _gc({1: {"dq": 1e-3}, 2: {"dq": 1.2e-3}, 4: {"dq": 1.2e-3}, 8: {"dq": 1.25e-3}})
    # baseline max(W1, W2)
    assert flat.passed and flat.growth[8]["dq"] == pytest.approx(1.25 / 1.2, rel=1e-2)
    grows = _gc({1: {"dq": 1e-3}, 2: {"dq": 1e-3}, 4: {"dq": 1.5e-3}, 8: {"dq": 2e-3}})
    assert (
        not grows.passed
        and grows.worst[:2] == (8, "dq")
        and grows.worst[2] == pytest.approx(2.0, rel=1e-2)
    )
    # the float32 merge allowance: (W - 2) float32 roundings at the scale of the summed terms
    t = max(cache.outputs(grows.cases[2])[0].term_scale["dq"].values())
    tiny = _gc({1: {"dq": 1e-9}, 2: {"dq": 1e-9}, 8: {"dq": 1e-9 + 6 * 2.0**-24 * t}})
    assert tiny.passed and tiny.growth[8]["dq"] == pytest.approx(1.0, rel=1e-6)


POOL_SIZE = 8  # ranks of the module's `pool` (tests/conftest.py)


BF16_NONE = dataclasses.replace(
    Capabilities(), masks=frozenset({"none"}), dtypes=frozenset({"bf16"})
)


@pytest.mark.parametrize(
    "impl, passes",
    [
        ("reference", True),
        ("flash-ring", True),
        ("mutant:dkv-travel-in-input-dtype", False),
        ("mutant:dq-accumulate-in-input-dtype", False),
        ("mutant:out-merge-in-input-dtype", False),
    ],
)
def test_correct_rings_pass_and_per_step_rounding_fails(pool, impl, passes):
    lines: list[str] = []
    res = growth.growth_check(pool, CheckOptions(impl=impl), BF16_NONE, lines.append)
    assert res.world_sizes == (1, 2, 4, 8) and len(res.cases) == 1
    gc = res.cases[0]
    assert set(gc.rms) == {1, 2, 4, 8} and all(r.verdict == "pass" for r in gc.results.values())
    assert res.passed is passes, lines
    w, t, g = gc.worst
    if passes:
        assert g < 1.15
    else:
        assert w == 8 and g > 1.6, lines
    assert lines[-1].startswith(f"growth check: {'pass' if passes else 'FAIL'}")
    assert res.to_dict()["cases"][0]["growth"][str(w)][t] == g


def test_skipped_for_fp32_only(pool):
    lines: list[str] = []
    res = growth.growth_check(
        pool, CheckOptions(impl="reference", dtype="fp32"), Capabilities(), lines.append
    )
    assert res.passed and res.skipped and not res.cases and "skipped" in lines[0]


def test_the_default_check_runs_the_growth_stage(pool, tmp_path):
    """The growth check is a stage of `check`: a per-step-rounding mutant that passes every single
    case fails it, with its own line in the verdict; the reference passes and the line states its
    figure."""
    from harness.checks.check import run_check
    from harness.checks.report import ListReporter
    from harness.checks.summary import outcome_json, verdict_line

    # the battery at W = 2 (cheaper); the growth check runs its own W = 1, 2, 4, 8
    opts = CheckOptions(
        impl="mutant:out-merge-in-input-dtype",
        world_size=2,
        dtype="bf16",
        max_examples=0,
        fault_stage=(),
        repeat=False,
        scale=False,
        save_dir=str(tmp_path),
    )
    rep = ListReporter()
    res = run_check(pool, opts, reporter=rep)
    assert all(r.passed for r in res.results)  # no single case shows it
    assert not res.passed and [f.stage for f in res.failures] == ["growth"]
    f = res.failures[0]
    assert (
        f.growth is not None
        and f.growth.worst[1] == "out"
        and f.result.case.world_size == f.growth.worst[0]
    )
    assert "growth check 1/2 global cases (out error x" in verdict_line(res)
    assert outcome_json(res)["growth"]["passed"] is False and not list(tmp_path.iterdir())

    ok = run_check(pool, opts.with_(impl="reference"), reporter=rep)
    assert ok.passed and ok.growth is not None and len(ok.growth.cases) == 2
    assert "growth check 16" not in verdict_line(ok) and "growth check 8," in verdict_line(ok)
    assert "the growth check's worst x" in verdict_line(ok)
    assert not run_check(pool, opts.with_(impl="reference", growth=False), reporter=rep).growth


def test_selftest_counts_a_growth_kill(pool, tmp_path):
    from harness.checks.selftest import run_one

    opts = CheckOptions(dtype="bf16", max_examples=0, fault_stage=(), repeat=False)
    run = run_one(pool, "mutant:dq-accumulate-in-input-dtype", opts, tmp_path, tmp_path)
    assert run.status == "killed" and run.stage == "growth" and run.verdict == "growth", run.note
    assert run.killed_by[0].startswith("error grows with W: dq error x") and run.path is None
