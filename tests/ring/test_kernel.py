"""Block kernel forward/backward against float64 autograd attention."""

from __future__ import annotations

import pytest
import torch

from harness.dtypes import TORCH_DTYPES
from ring_impl.kernel import block_backward, block_forward, gqa_kv_heads
from ring_impl.mask_eval import allowed
from ring_impl.masks import MaskSpec
from ring_impl.merge import merge

DTYPES = TORCH_DTYPES
# |error| / max|reference| allowed. The kernel computes in float32 from the dtype-rounded inputs and
# the float64 reference sees the same rounded inputs, so the only error is float32 rounding whatever
# the input dtype: measured worst 6.1e-7 (fp32 dk), 3.5e-7 (fp16 dq), 2.7e-7 (bf16 dq) over this
# file's cases. The bound, 2^-17 (= 64 float32 units, ~12x the worst measured), is still 64x below
# one fp16 unit and 512x below one bf16 unit, so a kernel that rounds any intermediate to the input
# dtype fails it (test_the_bound_catches_an_intermediate_rounding).
TOL = 2.0**-17
MASKS = [
    MaskSpec(),
    MaskSpec("causal"),
    MaskSpec("window", window=3),
    MaskSpec("document", doc_starts=(0, 5, 11)),
    MaskSpec("document", doc_starts=(0, 7), causal=False),
]
HEADS = [(4, 4), (4, 2), (6, 1)]


def reference(q, k, v, scale, mask):
    """float64 attention with explicit repeat_interleave GQA; returns (out, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def inputs(seed, lq, lk, hq, hkv, dtype, d=8, mult=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, lq, hq, d, generator=g) * mult).to(dtype)
    k = (torch.randn(2, lk, hkv, d, generator=g) * mult).to(dtype)
    v = torch.randn(2, lk, hkv, d, generator=g).to(dtype)
    return q, k, v


def positions(seed, lq, lk, total=24):
    """Random global positions of a query shard and a key block (any layout looks like this)."""
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randperm(total, generator=g)[:lq].sort().values, torch.randperm(
        total, generator=g
    )[:lk]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("spec", MASKS, ids=lambda s: f"{s.kind}{'' if s.causal else '-bi'}")
def test_forward_and_backward_match_float64(spec, heads, dt):
    seed = 100 * MASKS.index(spec) + 10 * HEADS.index(heads) + list(DTYPES).index(dt)
    q, k, v = inputs(seed, 9, 11, *heads, DTYPES[dt])
    q_pos, k_pos = positions(3, 9, 11)
    mask = allowed(spec, q_pos, k_pos)
    scale = 0.3
    out, lse = block_forward(q, k, v, scale, mask)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == (2, 9, heads[0], 8) and lse.shape == (2, heads[0], 9)

    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qd, kd, vd, scale, mask)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert rel_err(out, ref_out) < TOL
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-4

    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DTYPES[dt])
    ref_out.backward(dout.double())
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale, mask)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert got.dtype == torch.float32
        assert rel_err(got, want) < TOL


def test_gqa_uses_head_h_over_group_size():
    """Query head h must attend kv head h // g (repeat_interleave), not h % Hkv (repeat)."""
    idx = gqa_kv_heads(6, 2)
    assert idx.tolist() == [0, 0, 0, 1, 1, 1]
    q, k, v = inputs(1, 5, 7, 6, 2, torch.float32)
    out, _ = block_forward(q, k, v, 0.5, None)
    for h in range(6):
        per_head, _ = block_forward(
            q[:, :, h : h + 1], k[:, :, h // 3 : h // 3 + 1], v[:, :, h // 3 : h // 3 + 1], 0.5
        )
        torch.testing.assert_close(out[:, :, h : h + 1], per_head)
    with pytest.raises(ValueError):
        gqa_kv_heads(6, 4)


def test_fully_masked_rows_give_minus_inf_lse_zero_out_and_zero_grads():
    q, k, v = inputs(2, 4, 5, 2, 2, torch.float32)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    mask[3] = False
    out, lse = block_forward(q, k, v, 0.4, mask)
    assert torch.isneginf(lse[:, :, [1, 3]]).all() and torch.isfinite(lse[:, :, [0, 2]]).all()
    assert (out[:, [1, 3]] == 0).all() and not torch.isnan(out).any()
    dq, dk, dv = block_backward(torch.randn_like(out), q, k, v, out, lse, 0.4, mask)
    assert (dq[:, [1, 3]] == 0).all()
    assert not (torch.isnan(dq).any() or torch.isnan(dk).any() or torch.isnan(dv).any())
    # every row masked, and an empty key block
    out, lse = block_forward(q, k, v, 0.4, torch.zeros(4, 5, dtype=torch.bool))
    assert torch.isneginf(lse).all() and (out == 0).all()
    out, lse = block_forward(q, k[:, :0], v[:, :0], 0.4, None)
    assert out.shape == (2, 4, 2, 8) and (out == 0).all() and torch.isneginf(lse).all()


def test_keys_nobody_sees_get_exactly_zero_grads():
    q, k, v = inputs(4, 6, 8, 4, 2, torch.bfloat16)
    mask = torch.rand(6, 8, generator=torch.Generator().manual_seed(0)) < 0.6
    mask[:, [2, 5]] = False
    out, lse = block_forward(q, k, v, 0.35, mask)
    dq, dk, dv = block_backward(torch.randn(out.shape), q, k, v, out, lse, 0.35, mask)
    assert (dk[:, [2, 5]] == 0).all() and (dv[:, [2, 5]] == 0).all()
    assert (dk[:, [0, 1, 3, 4, 6, 7]] != 0).any(dim=-1).all()


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_large_logits_do_not_overflow(dt):
    """Scores of magnitude 100-200 in fp16/bf16 inputs: no inf/NaN, matches float64."""
    q, k, v = inputs(5, 8, 8, 2, 2, DTYPES[dt], d=16, mult=7.0)
    scale = 0.25
    mask = allowed(MaskSpec("causal"), torch.arange(8), torch.arange(8))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qd, kd, vd, scale, mask)
    s_max = (torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale).abs().max()
    assert 100 < s_max < 400
    out, lse = block_forward(q, k, v, scale, mask)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_err(out, ref_out) < 1e-3
    assert rel_err(lse, ref_lse) < 1e-5
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ref_out.backward(dout.double())
    grads = block_backward(dout.to(q.dtype), q, k, v, out, lse, scale, mask)
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad), strict=True):
        assert torch.isfinite(got).all()
        assert rel_err(got, want) < 2e-3


def test_backward_of_blocks_uses_the_global_out_and_lse():
    """Splitting the keys into blocks, merging forward and summing block backwards == full
    gradient."""
    q, k, v = inputs(6, 7, 12, 4, 2, torch.float32)
    mask = allowed(MaskSpec("window", window=5), torch.arange(3, 10), torch.arange(12))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference(qd, kd, vd, 0.5, mask)
    dout = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(2))
    ref_out.backward(dout.double())

    parts = [slice(0, 5), slice(5, 9), slice(9, 12)]
    blocks = [block_forward(q, k[:, s], v[:, s], 0.5, mask[:, s]) for s in parts]
    out, lse = blocks[0]
    for b_out, b_lse in blocks[1:]:
        out, lse = merge(out, lse, b_out, b_lse)
    dq = torch.zeros(q.shape)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    for s in parts:
        g_q, g_k, g_v = block_backward(dout, q, k[:, s], v[:, s], out, lse, 0.5, mask[:, s])
        dq += g_q
        dk[:, s] = g_k
        dv[:, s] = g_v
    assert rel_err(dq, qd.grad) < 1e-5
    assert rel_err(dk, kd.grad) < 1e-5
    assert rel_err(dv, vd.grad) < 1e-5


def test_rows_with_minus_inf_global_lse_contribute_nothing():
    """A row whose GLOBAL lse is -inf has no probability mass anywhere, whatever this block's
    scores."""
    q, k, v = inputs(8, 4, 5, 2, 2, torch.float32)
    out, lse = block_forward(q, k, v, 0.4, None)
    lse[:, :, 2] = float("-inf")
    out[:, 2] = 0
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, 0.4, None)
    keep = [0, 1, 3]
    ref = block_backward(dout[:, keep], q[:, keep], k, v, out[:, keep], lse[:, :, keep], 0.4, None)
    assert (dq[:, 2] == 0).all()
    torch.testing.assert_close(dk, ref[1])
    torch.testing.assert_close(dv, ref[2])


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_the_bound_catches_an_intermediate_rounding(dt):
    """One rounding of the output to the input dtype (what a kernel that accumulates or returns in
    fp16/bf16 does) exceeds TOL."""
    q, k, v = inputs(5, 9, 11, 4, 2, DTYPES[dt])
    out, _ = block_forward(q, k, v, 0.3, None)
    ref_out, _ = reference(q.double(), k.double(), v.double(), 0.3, None)
    assert rel_err(out, ref_out) < TOL
    assert rel_err(out.to(DTYPES[dt]), ref_out) > TOL
