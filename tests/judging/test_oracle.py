"""The float64 oracle against an independent computation: plain einsum attention with a brute-force
mask built by a double loop from the README's definitions (not ring_impl.masks), backward through
float64 autograd, for every mask kind, MHA/GQA/MQA, all five tensors, and query blocks that do and
do not divide the length (the oracle computes in blocks of queries and skips fully masked key
spans). Measured agreement: ~1e-15; the bound is 1e-12 (float64, sums of <= 40 terms)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.oracle import assemble
from ring_impl.masks import MaskSpec
from tests.helpers.masks import brute

N = 20
MASKS = [
    MaskSpec("none"),
    MaskSpec("causal"),
    MaskSpec("window", window=0),
    MaskSpec("window", window=3),
    MaskSpec("document", doc_starts=(0, 6, 7, 15)),
    MaskSpec("document", doc_starts=(0, 9), causal=False),
]
HEADS = [(4, 4), (4, 2), (6, 1)]


def independent(q, k, v, dout, spec: MaskSpec, scale: float):
    """float64 attention, brute-force mask, GQA by explicit head mapping h -> h // (Hq / Hkv)."""
    q, k, v = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    hq, hkv = q.shape[2], k.shape[2]
    kv_of = [h // (hq // hkv) for h in range(hq)]
    ke, ve = k[:, :, kv_of], v[:, :, kv_of]
    mask = torch.tensor([[brute(spec, i, j) for j in range(N)] for i in range(N)])
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("block", [1024, 4, 7])  # one block; blocks dividing N; blocks that do not
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}/{h[1]}")
@pytest.mark.parametrize(
    "spec",
    MASKS,
    ids=lambda s: f"{s.kind}{s.window if s.kind == 'window' else ''}{'' if s.causal else '-bi'}",
)
def test_oracle_matches_an_independent_float64_computation(monkeypatch, spec, heads, block):
    monkeypatch.setattr(assemble, "BLOCK", block)
    g = torch.Generator().manual_seed(100 * MASKS.index(spec) + 10 * HEADS.index(heads) + block)
    hq, hkv = heads
    q = torch.randn(2, N, hq, 8, generator=g)
    k = torch.randn(2, N, hkv, 8, generator=g)
    v = torch.randn(2, N, hkv, 8, generator=g)
    dout = torch.randn(2, N, hq, 8, generator=g)
    exact = assemble.attention(q, k, v, dout, spec, 0.37, torch.float64)
    want = independent(q, k, v, dout, spec, 0.37)
    got_all = (exact.out, exact.lse, exact.dq, exact.dk, exact.dv)
    for name, got, exp in zip(("out", "lse", "dq", "dk", "dv"), got_all, want, strict=True):
        assert got.dtype == torch.float64 and got.shape == exp.shape, name
        assert (got - exp).abs().max().item() < 1e-12, name


def test_the_independent_check_is_not_vacuous(monkeypatch):
    """A one-position mask slip (the window one key wider) is far outside the bound."""
    spec = MaskSpec("window", window=3)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, N, 2, 8, generator=g) for _ in range(4))
    exact = assemble.attention(q, k, v, dout, MaskSpec("window", window=4), 0.37, torch.float64)
    want = independent(q, k, v, dout, spec, 0.37)
    assert (exact.out - want[0]).abs().max().item() > 1e-3
