"""The oracle, the tolerance rule and the leak check, on synthetic shards (no ranks needed)."""

from __future__ import annotations

import pytest
import torch

from harness.case import make_case
from harness.judging import tolerance
from harness.judging.tensor_checks import check_leak, check_tensors
from harness.oracle import assemble
from harness.oracle.cache import outputs
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec


def _shards(case, exact, perturb=None):
    out = {}
    for r, pos in enumerate(all_positions(case.layout, case.seq_lens)):
        t = {n: getattr(exact, n).index_select(1, pos).clone() for n in ("out", "dq", "dk", "dv")}
        if perturb:
            perturb(r, t)
        out[r] = t
    return out


def test_blockwise_oracle_equals_one_block(monkeypatch):
    c = make_case(
        world_size=1, total_len=50, heads_q=4, heads_kv=2, mask={"kind": "window", "window": 7}
    )
    whole = outputs(c)[0]
    monkeypatch.setattr(assemble, "BLOCK", 8)
    from harness import inputs

    g = inputs.make_global(c)
    blocked = assemble.attention(g["q"], g["k"], g["v"], g["dout"], c.mask, c.scale, torch.float64)
    for n in ("out", "lse", "dq", "dk", "dv"):
        torch.testing.assert_close(getattr(blocked, n), getattr(whole, n), rtol=1e-12, atol=1e-12)


def test_oracle_matches_sdpa_float64():
    c = make_case(world_size=1, total_len=33, mask={"kind": "causal"})
    from harness import inputs

    g = {k: v.double() for k, v in inputs.make_global(c).items()}
    exact = assemble.attention(g["q"], g["k"], g["v"], g["dout"], c.mask, c.scale, torch.float64)
    q, k, v = (g[n].transpose(1, 2).requires_grad_() for n in ("q", "k", "v"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(g["dout"].transpose(1, 2))
    torch.testing.assert_close(exact.out, out.transpose(1, 2).detach())
    torch.testing.assert_close(exact.dk, k.grad.transpose(1, 2))


def test_the_exact_outputs_pass_and_a_small_error_fails():
    for dtype in ("fp32", "bf16"):
        c = make_case(
            world_size=2, total_len=20, dtype=dtype, mask={"kind": "causal"}, layout="zigzag"
        )
        exact, base = outputs(c)
        assert all(ch.passed for ch in check_tensors(c, _shards(c, exact), exact, base))
        # an error twice the allowed bound on one element of one rank's dk is caught, with its
        # position
        probe = check_tensors(c, _shards(c, exact), exact, base)
        allowed = next(ch.allowed for ch in probe if ch.tensor == "dk")

        def bump(r, t, allowed=allowed):
            if r == 1:
                t["dk"][0, 2, 1, 3] += 2 * allowed

        checks = check_tensors(c, _shards(c, exact, bump), exact, base)
        bad = [ch for ch in checks if not ch.passed]
        assert [(ch.tensor, ch.rank) for ch in bad] == [("dk", 1)]
        pos = all_positions(c.layout, c.seq_lens)[1]
        assert bad[0].position == {"batch": 0, "token": int(pos[2]), "head": 1}
        assert 1.9 < bad[0].ratio < 2.1


def test_nan_is_a_failure():
    c = make_case(world_size=2, total_len=8)
    exact, base = outputs(c)

    def nan(r, t):
        t["out"][0, 0, 0, 0] = float("nan")

    checks = check_tensors(c, _shards(c, exact, nan), exact, base)
    assert sum(not ch.passed for ch in checks) == 2 and all(
        ch.ratio == float("inf") for ch in checks if not ch.passed
    )


def test_bound_scales_with_base_error():
    e32, e16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    close = pytest.approx
    # out: 3 unit roundoffs (u = eps/2) of the dtype plus W float32 units, at max(terms, |exact|)
    assert tolerance.bound("out", "fp32", 0.0, 1.0) == close(1.5 * e32 + e32)
    assert tolerance.bound("out", "fp32", 0.0, 2.0, world_size=4) == close(2.0 * (1.5 + 4) * e32)
    # dq: 3 u at its terms' scale + 4 u where D's error enters (one number here: both scales)
    assert tolerance.bound("dq", "bf16", 0.01, 1.0) == close(3 * 0.01 + 3.5 * e16 + e32)
    assert tolerance.bound("dq", "bf16", 0.01, 1.0, {"dq": 5}) == close(5 * 0.01 + 3.5 * e16 + e32)
    # a result that is exactly 0 still allows roundings at the scale of its terms
    assert tolerance.bound(
        "dq", "fp32", 0.0, 0.0, world_size=1, lse_absmax=1.0, term_scale=0.5
    ) == close(0.5 * (3.5 + 2) * e32)


def test_leak_check_is_exact():
    c = make_case(world_size=2, total_len=16, mask={"kind": "causal"}, seed=5)
    from harness import inputs

    s = inputs.leak_queries(c)
    pos_all = all_positions(c.layout, c.seq_lens)
    clean = {
        r: {"dk": torch.zeros(1, len(p), 2, 16), "dv": torch.zeros(1, len(p), 2, 16)}
        for r, p in enumerate(pos_all)
    }
    assert check_leak(c, clean).passed
    from ring_impl.mask_eval import visible_keys

    hidden_keys = (~visible_keys(c.mask, s, 16)).nonzero().view(-1)
    assert hidden_keys.numel() > 0, "seed 5 must leave some keys hidden"
    hidden = int(hidden_keys[-1])
    r = next(r for r, p in enumerate(pos_all) if hidden in p.tolist())
    i = pos_all[r].tolist().index(hidden)
    clean[r]["dv"][0, i, 0, 0] = 1e-30  # any nonzero at all is a leak
    res = check_leak(c, clean)
    assert not res.passed and res.leaks[0]["token"] == hidden and res.leaks[0]["tensor"] == "dv"


def test_no_leak_check_without_mask():
    c = make_case(world_size=1, total_len=4, mask=MaskSpec("none"))
    assert check_leak(c, {0: {}}) is None


# -- the precision check: a tensor returned in the case's dtype carries that dtype's precision
# ---------


def test_coarse_grid_names_the_narrower_dtype_a_tensor_went_through():
    from harness.judging.tensor_checks import GRID_MIN_VALUES, coarse_grid

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 32, generator=g)
    # on no grid: the distinct values are not counted (issue #55: counting sorts the tensor)
    assert coarse_grid(x.half(), "fp16") == ("", 0)
    assert coarse_grid(x.to(torch.bfloat16).half(), "fp16") == ("bf16", 119)  # distinct values
    assert coarse_grid(x, "fp32") == ("", 0)
    # one value repeated is one sample, whatever the tensor's size (uniform softmax, one-dimensional
    # head)
    assert coarse_grid(torch.full((500,), 0.375, dtype=torch.half), "fp16") == ("", 1)
    assert coarse_grid(x.half().float(), "fp32")[0] == "fp16"
    assert coarse_grid(x.to(torch.bfloat16).float(), "fp32")[0] == "bf16"  # the coarsest first
    assert coarse_grid(x.to(torch.bfloat16), "bf16") == ("", 0)  # nothing narrower to go through
    # zeros and subnormals are not evidence; too few values give no verdict
    few = x.to(torch.bfloat16).half().reshape(-1)[: GRID_MIN_VALUES - 1]
    assert coarse_grid(torch.cat([few, torch.zeros(500, dtype=torch.half)]), "fp16")[0] == ""
    # values below the floor (heavy cancellation: few significant bits even when correct) are no
    # evidence
    assert coarse_grid(x.to(torch.bfloat16).half() * 1e-3, "fp16", floor=0.01) == ("", 0)
    # one value off the grid is enough to clear it
    y = x.to(torch.bfloat16).half()
    # 1 + 2^-10: an fp16 value, not a bf16 one
    y[0, 0] = torch.tensor(1.0009765625, dtype=torch.half)
    assert coarse_grid(y, "fp16")[0] == ""


def test_correct_fp16_results_are_not_on_the_bf16_grid():
    """The false-alarm side on real arithmetic: float64 results rounded once to fp16 (what a correct
    kernel returns at best) over 200 seeds and every tensor: never all on the bf16 grid."""
    from harness.judging.tensor_checks import coarse_grid

    for seed in range(200):
        c = make_case(
            world_size=1,
            total_len=16,
            heads_q=2,
            heads_kv=1,
            head_dim=8,
            seed=seed,
            dtype="fp16",
            mask={"kind": "causal"},
        )
        exact = outputs(c)[0]
        for n in ("out", "dq", "dk", "dv"):
            assert coarse_grid(getattr(exact, n).half(), "fp16")[0] == "", (seed, n)


def test_a_tensor_rounded_through_bf16_fails_within_the_error_bound():
    c = make_case(
        world_size=2, total_len=32, heads_q=2, heads_kv=2, head_dim=16, dtype="fp16", seed=3
    )
    exact, base = outputs(c)
    shards = {r: {n: t.half() for n, t in s.items()} for r, s in _shards(c, exact).items()}
    assert all(ch.passed for ch in check_tensors(c, shards, exact, base))
    for s in shards.values():
        s["dq"] = s["dq"].to(torch.bfloat16).half()
    bad = [ch for ch in check_tensors(c, shards, exact, base) if not ch.passed]
    assert {(ch.tensor, ch.grid) for ch in bad} == {("dq", "bf16")} and len(bad) == 2
    # the bound alone passes it
    assert all(ch.error <= ch.allowed and 64 <= ch.grid_values <= 512 for ch in bad)


@pytest.mark.parametrize("seed", range(4))
def test_the_judge_s_short_paths_give_the_long_paths_values(seed):
    """`_diff` without infinities in the oracle, and `_finite_max` with a finite top, skip passes
    over the tensor (issue #55). They must give the very values of the long paths, NaN and infinity
    in the ranks' tensor included."""
    from harness.judging import tensor_checks as tc

    g = torch.Generator().manual_seed(seed)
    want = torch.randn(2, 37, 3, 8, generator=g, dtype=torch.float64)
    got = want + 1e-3 * torch.randn(want.shape, generator=g, dtype=torch.float64)
    flat = got.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:6]
    flat[idx[:2]], flat[idx[2:4]], flat[idx[4:]] = float("nan"), float("inf"), float("-inf")
    assert not tc._has_inf(want)
    long_path = tc._diff(got, want)
    assert torch.equal(
        tc._diff(got, want, want_inf=False).nan_to_num(nan=7.0), long_path.nan_to_num(nan=7.0)
    )
    for t in (want, got, torch.empty(0), torch.full((3,), float("-inf")), -want):
        a = t.abs()
        finite = a[torch.isfinite(a)]
        expected = float(finite.max()) if finite.numel() else 0.0
        assert tc._finite_max(t) == expected
