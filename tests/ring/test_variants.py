"""The reference ring's variants on one process, against float64 autograd (docs/case-model.md).

The brute force materialises the whole score matrix, applies softcap and ALiBi, adds the sink as
one more logit column with a zero value, and lets autograd take every gradient, the sinks' too.
The pool's tests (W > 1) run the same variants through the oracle.
"""

from __future__ import annotations

import math

import pytest
import torch

from ring_impl import ring_attention
from ring_impl.kernel import block_backward, block_forward
from ring_impl.masks import MaskSpec, prim
from ring_impl.variants import Scores, Variant, alibi_slopes


def brute(q, k, v, scale, *, causal=False, softcap=None, slopes=None, sinks=None, pos=None):
    """(out, lse) in float64 by autograd-able torch ops; the sink is a zero-valued logit column."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    n = q.shape[1]
    pos = torch.arange(n) if pos is None else pos
    if slopes is not None:
        dist = (pos.view(-1, 1) - pos.view(1, -1)).abs().to(s.dtype)
        s = s - torch.as_tensor(slopes, dtype=s.dtype).view(1, -1, 1, 1) * dist
    if causal:
        s = s.masked_fill(pos.view(-1, 1) < pos.view(1, -1), float("-inf"))
    if sinks is not None:
        col = sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, col], dim=-1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, *v.shape[2:])], dim=1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


CASES = {
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "dv-smaller": dict(dv=4),
    "dv-larger": dict(dv=24),
    "all": dict(softcap=3.0, alibi=True, sinks=True, dv=12),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_matches_float64_autograd(name, causal):
    spec = CASES[name]
    torch.manual_seed(3)
    b, n, hq, hkv, d = 2, 9, 4, 2, 16
    dv = spec.get("dv", d)
    q, k = torch.randn(b, n, hq, d) * 2, torch.randn(b, n, hkv, d) * 2
    v, dout = torch.randn(b, n, hkv, dv), torch.randn(b, n, hq, dv)
    slopes = alibi_slopes(hq) if spec.get("alibi") else None
    sink_values = torch.tensor([0.0, 2.5, 4.0, -1.0]) if spec.get("sinks") else None
    scale = d**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = None if sink_values is None else sink_values.clone().requires_grad_()
    out, lse = ring_attention(
        *leaves,
        mask=MaskSpec("causal" if causal else "none"),
        return_lse=True,
        softcap=spec.get("softcap"),
        alibi_slopes=slopes,
        sinks=sinks,
    )
    out.backward(dout)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    rsinks = None if sink_values is None else sink_values.double().requires_grad_()
    rout, rlse = brute(
        *ref, scale, causal=causal, softcap=spec.get("softcap"), slopes=slopes, sinks=rsinks
    )
    rout.backward(dout.double())
    assert out.shape == (b, n, hq, dv)
    torch.testing.assert_close(out.double(), rout, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), rlse.detach(), atol=2e-5, rtol=1e-5)
    for mine, theirs in zip(leaves, ref, strict=True):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, atol=5e-5, rtol=1e-4)
    if sinks is not None:
        assert sinks.grad.abs().max() > 1e-3  # the sinks matter here
        torch.testing.assert_close(sinks.grad.double(), rsinks.grad, atol=5e-5, rtol=1e-4)


def test_a_row_with_no_key_but_a_sink_has_out_zero_and_lse_the_sink():
    q, k, v = (torch.randn(1, 3, 2, 4).requires_grad_() for _ in range(3))
    sinks = torch.tensor([1.5, -2.0], requires_grad=True)
    nothing = MaskSpec.of(prim("prefix", 0))  # no query sees any key
    out, lse = ring_attention(q, k, v, mask=nothing, sinks=sinks, return_lse=True)
    assert (out == 0).all() and torch.equal(lse, sinks.detach().view(1, 2, 1).expand(1, 2, 3))
    out.backward(torch.randn_like(out))
    assert (q.grad == 0).all() and (sinks.grad == 0).all()


def test_the_tiled_kernel_applies_the_variant_tile_by_tile():
    """Forced 4-token tiles give the one-tile path's numbers, ALiBi from each tile's positions."""
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 11, 2, 8), torch.randn(1, 13, 2, 8), torch.randn(1, 13, 2, 6)
    qp, kp = torch.arange(20, 31), torch.arange(0, 26, 2)
    fn = Scores.of(Variant(softcap=1.5, alibi=tuple(alibi_slopes(2))), qp, kp)
    whole = block_forward(q, k, v, 0.3, None, scores=fn)
    tiled = block_forward(q, k, v, 0.3, None, scores=fn, tile=4)
    torch.testing.assert_close(tiled, whole, atol=1e-6, rtol=1e-5)
    dout = torch.randn(1, 11, 2, 6)
    out, lse = whole
    g1 = block_backward(dout, q, k, v, out, lse, 0.3, None, scores=fn)
    g2 = block_backward(dout, q, k, v, out, lse, 0.3, None, scores=fn, tile=4)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_alibi_slopes_follow_the_paper():
    assert alibi_slopes(8) == [2.0 ** (-(h + 1)) for h in range(8)]
    six = alibi_slopes(6)  # 4 of the power-of-two series, then every other one of 8's
    assert six[:4] == alibi_slopes(4) and six[4:] == alibi_slopes(8)[0::2][:2]
    assert all(math.isfinite(x) and 0 < x < 1 for x in alibi_slopes(12))
