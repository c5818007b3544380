"""ring_attention with no process group (W=1) against float64 attention, plus its input checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.dtypes import TORCH_DTYPES
from ring_impl import REFERENCE_PARTS, MaskSpec, make_ring_attention, ring_attention
from ring_impl.buffers import DoubleBuffer
from ring_impl.comm import LocalComm
from ring_impl.mask_eval import full_mask

DTYPES = TORCH_DTYPES
# |err| / max|ref|; bf16/fp16 include output rounding
TOL = {"fp32": 2e-5, "fp16": 3e-3, "bf16": 2e-2}
MASKS = [
    MaskSpec(),
    MaskSpec("causal"),
    MaskSpec("window", window=2),
    MaskSpec("document", doc_starts=(0, 3, 8)),
    MaskSpec("document", doc_starts=(0, 6), causal=False),
]


def reference(q, k, v, spec, scale):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    m = full_mask(spec, q.shape[1])
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v), torch.logsumexp(s, -1)


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def make(seed, n, hq, hkv, dtype, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, h, d, generator=g).to(dtype).requires_grad_() for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("spec", MASKS, ids=lambda s: f"{s.kind}{'' if s.causal else '-bi'}")
def test_matches_float64(spec, heads, dt):
    seed = 10 * MASKS.index(spec) + list(DTYPES).index(dt)
    q, k, v = make(seed, 11, *heads, DTYPES[dt])
    out, lse = ring_attention(q, k, v, mask=spec, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, heads[0], 11)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(q.dtype)
    out.backward(dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qd, kd, vd, spec, 8**-0.5)
    ref_out.backward(dout.double())
    assert rel_err(out, ref_out) < TOL[dt]
    assert (lse.double() - ref_lse).abs().max() < 1e-4
    for t, ref in ((q, qd), (k, kd), (v, vd)):
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        assert rel_err(t.grad, ref.grad) < 3 * TOL[dt]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_every_layout_is_the_identity_at_w1(layout):
    q, k, v = make(3, 7, 2, 2, torch.float32)
    spec = MaskSpec("causal")
    out = ring_attention(q, k, v, layout=layout, lengths=[7], mask=spec)
    ref, _ = reference(q, k, v, spec, 8**-0.5)
    assert rel_err(out, ref) < 1e-5


def test_softmax_scale_is_used():
    q, k, v = make(4, 6, 2, 1, torch.float32)
    out = ring_attention(q, k, v, softmax_scale=0.9)
    assert rel_err(out, reference(q, k, v, MaskSpec(), 0.9)[0]) < 1e-5
    assert rel_err(out, reference(q, k, v, MaskSpec(), 8**-0.5)[0]) > 1e-2


def test_large_logits_bf16_stay_finite():
    q, k, v = make(5, 9, 2, 2, torch.bfloat16, d=16)
    with torch.no_grad():
        q.mul_(7)
        k.mul_(7)
    out, lse = ring_attention(q, k, v, mask=MaskSpec("causal"), return_lse=True)
    out.backward(torch.ones_like(out))
    assert lse.max() > 100
    for t in (out, lse, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    ref_out, _ = reference(q, k, v, MaskSpec("causal"), 0.25)
    assert rel_err(out, ref_out) < 2e-2


def test_empty_local_shard():
    q, k, v = make(6, 0, 2, 2, torch.float32)
    out, lse = ring_attention(q, k, v, mask=MaskSpec("causal"), return_lse=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_rejects_bad_inputs():
    q, k, v = make(7, 5, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="lengths"):
        ring_attention(q, k, v, lengths=[4])
    with pytest.raises(ValueError, match="ranks"):
        ring_attention(q, k, v, lengths=[5, 5])
    with pytest.raises(ValueError, match="multiple"):
        ring_attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(ValueError, match="dtype|fp32"):
        ring_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="same length"):
        ring_attention(q, k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="not initialised"):
        ring_attention(q, k, v, group=object())
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, k, v, layout="diagonal")


def test_parts_are_replaceable():
    """make_ring_attention(REFERENCE_PARTS) is the reference; replacing a part changes the ring."""
    q, k, v = make(8, 6, 2, 2, torch.float32)
    same = make_ring_attention(REFERENCE_PARTS)(q, k, v, mask=MaskSpec("causal"))
    assert torch.equal(same, ring_attention(q, k, v, mask=MaskSpec("causal")))
    half_scale = dataclasses.replace(REFERENCE_PARTS, scale=lambda s, d: 0.5 * d**-0.5)
    other = make_ring_attention(half_scale)(q, k, v, mask=MaskSpec("causal"))
    assert not torch.allclose(other, same)


def test_double_buffer_views_are_sized_per_owner():
    shapes = [(1, 3, 2, 4), (1, 0, 2, 4), (1, 5, 2, 4)]
    buf = DoubleBuffer([(s, s) for s in shapes], torch.float32, torch.device("cpu"))
    assert buf.slots[0].numel() == 2 * 5 * 8
    k, v = buf.load(0, 0, torch.ones(1, 3, 2, 4), torch.full((1, 3, 2, 4), 2.0))
    assert buf.flat(0, 0).numel() == 48 and buf.flat(0, 1).numel() == 0
    assert [t.shape for t in buf.views(1, 1)] == [(1, 0, 2, 4)] * 2
    comm = LocalComm()
    comm.exchange(buf.flat(0, 0), buf.flat(1, 0))
    comm.wait()
    k1, v1 = buf.views(1, 0)
    assert (k1 == 1).all() and (v1 == 2).all()


def test_double_buffer_blocks_may_hold_tensors_of_two_shapes():
    """v with a head dim of its own (MLA) rides in the same slot as k."""
    buf = DoubleBuffer([((1, 3, 2, 8), (1, 3, 2, 4))] * 2, torch.float32, torch.device("cpu"))
    k, v = buf.load(0, 1, torch.ones(1, 3, 2, 8), torch.full((1, 3, 2, 4), 2.0))
    assert buf.flat(0, 1).numel() == 48 + 24 and k.shape[-1] == 8 and v.shape[-1] == 4
    assert (buf.views(0, 1)[1] == 2).all()
