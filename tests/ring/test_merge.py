"""The shared merge against a float64 log-sum-exp combination, including -inf and huge lse."""

from __future__ import annotations

import math

import pytest
import torch

from ring_impl.merge import merge

INF = float("inf")


def expected(out, lse, b_out, b_lse):
    """float64 combination: weights exp(lse_i - logaddexp(lse, b_lse)), 0 where both are -inf."""
    out, lse, b_out, b_lse = out.double(), lse.double(), b_out.double(), b_lse.double()
    new = torch.logaddexp(lse, b_lse)
    ref = torch.where(torch.isfinite(new), new, 0)
    w1 = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w2 = torch.exp(b_lse - ref).transpose(1, 2).unsqueeze(-1)
    return w1 * out + w2 * b_out, new


def parts(seed, lse_scale=3.0, lse_shift=0.0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(2, 5, 3, 4, generator=g)
    lse = torch.randn(2, 3, 5, generator=g) * lse_scale + lse_shift
    return out, lse


def check(got, want, tol=1e-6):
    (o, lse), (eo, el) = got, want
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(el))
    assert torch.isfinite(o).all()
    fin = torch.isfinite(el)
    assert (lse[fin].double() - el[fin]).abs().max().item() <= tol * max(
        1.0, el[fin].abs().max().item()
    )
    assert (o.double() - eo).abs().max().item() <= tol


@pytest.mark.parametrize("seed", range(4))
def test_random_blocks(seed):
    a, b = parts(seed), parts(seed + 10)
    check(merge(*a, *b), expected(*a, *b))


def test_merge_of_blocks_equals_softmax_over_all_keys():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, 2, 3, 10, generator=g, dtype=torch.float64) * 4  # (B, H, L, K) scores
    v = torch.randn(1, 10, 2, 5, generator=g, dtype=torch.float64)
    full = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)

    def block(sl):
        return torch.einsum(
            "bhqk,bkhd->bqhd", s[..., sl].softmax(-1), v[:, sl]
        ).float(), torch.logsumexp(s[..., sl], -1).float()

    out, lse = merge(*block(slice(0, 4)), *block(slice(4, 10)))
    assert (out.double() - full).abs().max() < 1e-6
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() < 1e-5


def test_minus_inf_on_either_side_and_both():
    out, lse = parts(1)
    b_out, b_lse = parts(2)
    lse[0, 1, :2] = -INF  # left side empty
    b_lse[1, 0, 3] = -INF  # right side empty
    lse[1, 2, 4] = b_lse[1, 2, 4] = -INF  # both empty
    new_out, new_lse = merge(out, lse, b_out, b_lse)
    check((new_out, new_lse), expected(out, lse, b_out, b_lse))
    assert torch.equal(new_out[0, :2, 1], b_out[0, :2, 1])  # weight exactly 1 for the only side
    assert torch.equal(new_out[1, 3, 0], out[1, 3, 0])
    assert (new_out[1, 4, 2] == 0).all() and new_lse[1, 2, 4] == -INF


@pytest.mark.parametrize("shift", [1e3, 1e4, -1e4, 3e4])
def test_huge_lse_does_not_overflow(shift):
    out, lse = parts(3, lse_shift=shift)
    b_out, b_lse = parts(4, lse_shift=shift)
    check(merge(out, lse, b_out, b_lse), expected(out, lse, b_out, b_lse), tol=1e-6)


def test_far_apart_lse_takes_the_dominant_side():
    """block_lse - lse = +-200: exp of the difference overflows float32, the merge must not."""
    out, lse = parts(5, lse_scale=0.0)
    b_out, b_lse = parts(6, lse_scale=0.0)
    assert math.isinf(torch.exp(torch.tensor(200.0)).item())
    got_out, got_lse = merge(out, lse, b_out, b_lse + 200)
    assert torch.allclose(got_out, b_out) and torch.allclose(got_lse, b_lse + 200)
    got_out, got_lse = merge(out, lse + 200, b_out, b_lse)
    assert torch.allclose(got_out, out) and torch.allclose(got_lse, lse + 200)


def test_order_does_not_matter():
    blocks = [parts(s) for s in range(4)]
    fwd = blocks[0]
    for b in blocks[1:]:
        fwd = merge(*fwd, *b)
    rev = blocks[-1]
    for b in reversed(blocks[:-1]):
        rev = merge(*rev, *b)
    assert torch.allclose(fwd[0], rev[0], atol=1e-6) and torch.allclose(fwd[1], rev[1], atol=1e-6)
