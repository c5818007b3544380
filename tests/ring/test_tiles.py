"""The tiled block kernel (blocks larger than a tile): against float64 attention and against the
one-tile kernel, for every mask kind, GQA, uneven and non-multiple lengths, fp32/fp16/bf16; the
tile plan (one tile for every battery-sized block); and the ring on one process with a tiny tile
budget."""

from __future__ import annotations

import pytest
import torch

from harness.dtypes import TORCH_DTYPES
from ring_impl import MaskSpec, ring_attention
from ring_impl import kernel as K
from ring_impl.kernel import TileMask, block_backward, block_forward
from ring_impl.mask_eval import allowed, full_mask
from tests.ring.test_kernel import reference, rel_err  # the float64 referee and the error measure

DTYPES = TORCH_DTYPES
# the kernel's own float64 bound (tests/ring/test_kernel.py): float32 rounding only, whatever the
# tiles
TOL = 2.0**-17
MASKS = [
    MaskSpec(),
    MaskSpec("causal"),
    MaskSpec("window", window=3),
    MaskSpec("document", doc_starts=(0, 5, 11, 19)),
    MaskSpec("document", doc_starts=(0, 7, 16), causal=False),
]
HEADS = [(4, 4), (4, 2), (6, 1)]
SHAPES = [(13, 17, 4), (9, 23, 5), (20, 7, 8)]  # (Lq, Lk, tile): uneven, tile not dividing either


def make(seed, lq, lk, hq, hkv, dtype, d=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, lq, hq, d, generator=g).to(dtype),
        torch.randn(2, lk, hkv, d, generator=g).to(dtype),
        torch.randn(2, lk, hkv, d, generator=g).to(dtype),
    )


def positions(seed, lq, lk, total=26):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randperm(total, generator=g)[:lq].sort().values, torch.randperm(
        total, generator=g
    )[:lk]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}t{s[2]}")
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("spec", MASKS, ids=lambda s: f"{s.kind}{'' if s.causal else '-bi'}")
def test_tiled_matches_float64_and_the_one_tile_kernel(spec, heads, dt, shape):
    lq, lk, tile = shape
    seed = (
        100 * MASKS.index(spec)
        + 10 * HEADS.index(heads)
        + list(DTYPES).index(dt)
        + 1000 * SHAPES.index(shape)
    )
    q, k, v = make(seed, lq, lk, *heads, DTYPES[dt])
    q_pos, k_pos = positions(seed, lq, lk)
    mask = allowed(spec, q_pos, k_pos)
    out, lse = block_forward(q, k, v, 0.3, mask, tile=tile)
    whole_out, whole_lse = block_forward(q, k, v, 0.3, mask)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qd, kd, vd, 0.3, mask)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.equal(torch.isneginf(lse), ~finite)
    assert rel_err(out, ref_out) < TOL and rel_err(out, whole_out) < TOL
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-5
    assert (lse[finite] - whole_lse[finite]).abs().max() < 1e-5
    assert (out[~finite.transpose(1, 2).unsqueeze(-1).expand_as(out)] == 0).all()

    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(DTYPES[dt])
    ref_out.backward(dout.double())
    grads = block_backward(dout, q, k, v, out, lse, 0.3, mask, tile=tile)
    whole = block_backward(dout, q, k, v, out, lse, 0.3, mask)
    for got, one, want in zip(grads, whole, (qd.grad, kd.grad, vd.grad), strict=True):
        assert got.dtype == torch.float32 and got.shape == one.shape
        assert rel_err(got, want) < TOL and rel_err(got, one) < TOL
    if mask is not None:  # keys no query may see: exactly zero, as in the one-tile kernel
        hidden = ~mask.any(dim=0)
        assert (grads[1][:, hidden] == 0).all() and (grads[2][:, hidden] == 0).all()


@pytest.mark.parametrize("spec", MASKS[1:], ids=lambda s: f"{s.kind}{'' if s.causal else '-bi'}")
def test_a_lazy_tile_mask_gives_the_same_bits_as_the_tensor(spec):
    q, k, v = make(5, 19, 21, 4, 2, torch.bfloat16)
    q_pos, k_pos = positions(5, 19, 21)
    calls = []

    def tile(qs, ks):
        calls.append((qs, ks))
        return allowed(spec, q_pos[qs], k_pos[ks])

    lazy = TileMask(tile, (19, 21))
    dense = allowed(spec, q_pos, k_pos)
    for a, b in zip(
        block_forward(q, k, v, 0.5, lazy, tile=8),
        block_forward(q, k, v, 0.5, dense, tile=8),
        strict=True,
    ):
        assert torch.equal(a, b)
    assert calls and all(
        (qs.stop - qs.start) <= 8 and (ks.stop - ks.start) <= 8 for qs, ks in calls
    )
    out, lse = block_forward(q, k, v, 0.5, dense)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(
        block_backward(dout, q, k, v, out, lse, 0.5, lazy, tile=8),
        block_backward(dout, q, k, v, out, lse, 0.5, dense, tile=8),
        strict=True,
    ):
        assert torch.equal(a, b)
    # one tile: the lazy mask is asked once for the whole block, the result is the tensor path's,
    # bit for bit
    calls.clear()
    assert torch.equal(block_forward(q, k, v, 0.5, lazy)[0], block_forward(q, k, v, 0.5, dense)[0])
    assert calls == [(slice(None), slice(None))]


def test_fully_masked_rows_tiles_and_blocks():
    q, k, v = make(2, 10, 12, 2, 2, torch.float32)
    mask = torch.ones(10, 12, dtype=torch.bool)
    mask[1] = False
    mask[6:, :] = False  # whole query tiles see nothing
    mask[:, 4:8] = False  # a whole key tile hidden
    out, lse = block_forward(q, k, v, 0.4, mask, tile=4)
    assert (
        torch.isneginf(lse[:, :, [1, 6, 7, 8, 9]]).all()
        and torch.isfinite(lse[:, :, [0, 2, 3, 4, 5]]).all()
    )
    assert (out[:, [1, 6, 7, 8, 9]] == 0).all() and not torch.isnan(out).any()
    dq, dk, dv = block_backward(torch.randn_like(out), q, k, v, out, lse, 0.4, mask, tile=4)
    assert (
        (dq[:, [1, 6, 7, 8, 9]] == 0).all() and (dk[:, 4:8] == 0).all() and (dv[:, 4:8] == 0).all()
    )
    assert not (torch.isnan(dq).any() or torch.isnan(dk).any() or torch.isnan(dv).any())
    out, lse = block_forward(q, k, v, 0.4, torch.zeros(10, 12, dtype=torch.bool), tile=4)
    assert torch.isneginf(lse).all() and (out == 0).all()


def test_huge_scores_stay_finite_across_tiles():
    """Running max over tiles: a later tile with a much larger max rescales the earlier ones."""
    q, k, v = make(3, 8, 16, 2, 2, torch.float32)
    # the last key tile dominates: exp of the first tiles' scores underflows to 0
    k[:, 12:] *= 300.0
    out, lse = block_forward(q, k, v, 1.0, None, tile=4)
    ref_out, ref_lse = reference(q, k, v, 1.0, None)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (
        rel_err(out, ref_out) < TOL
        and (lse.double() - ref_lse).abs().max() / ref_lse.abs().max() < 1e-6
    )


def test_tile_plan(monkeypatch):
    monkeypatch.delenv(K.TILE_ENV, raising=False)
    assert K.tile_scores("cpu") == K.CPU_TILE_SCORES == 1 << 22
    assert (
        K.tile_for(4, 1 << 22) == 1024
        and K.tile_for(8, 1 << 22) == 512
        and K.tile_for(1 << 30, 1) == K.MIN_TILE
    )
    # battery- and corpus-sized blocks (tens of tokens) and the speed benchmark's 1024 x 1024 x h4
    # blocks are one tile: the untouched one-tile path, so recorded hashes stay bit for bit
    assert not K.needs_tiles(1, 8, 64, 64) and not K.needs_tiles(1, 4, 1024, 1024)
    assert K.needs_tiles(1, 4, 8192, 8192) and K.needs_tiles(1, 4, 1025, 1024)
    monkeypatch.setenv(K.TILE_ENV, "64")
    assert K.tile_scores() == 64 and K.needs_tiles(1, 1, 9, 8)


@pytest.mark.parametrize("spec", MASKS, ids=lambda s: f"{s.kind}{'' if s.causal else '-bi'}")
def test_single_process_ring_with_a_tiny_tile_budget(spec, monkeypatch):
    """W=1 ring (a block of the whole sequence) tiled by the device budget: the ring hands the
    kernel a lazy mask; results within the fp32 bound of the one-tile ring and of float64."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(1, 37, h, 8, generator=g).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2)
    )
    dout = torch.randn(1, 37, 4, 8, generator=g).to(torch.bfloat16)

    def run():
        for t in (q, k, v):
            t.grad = None
        out, lse = ring_attention(q, k, v, mask=spec, return_lse=True)
        out.backward(dout)
        return out, lse, q.grad.clone(), k.grad.clone(), v.grad.clone()

    monkeypatch.delenv(K.TILE_ENV, raising=False)
    whole = run()
    monkeypatch.setenv(K.TILE_ENV, str(4 * 8 * 8))  # h4 x 8 x 8: tiles of 8 tokens
    tiled = run()
    m = full_mask(spec, 37)
    _, ref_lse = reference(q.detach(), k.detach(), v.detach(), 8**-0.5, m)
    assert (tiled[1].double() - ref_lse).abs().max() < 1e-5
    for a, b in zip(tiled, whole, strict=True):
        # bf16 outputs: the tiled and one-tile float32 results round to the same or an adjacent bf16
        # value
        assert rel_err(a, b) < 2.0**-7
