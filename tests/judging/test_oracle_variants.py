"""Issue #53: the float64 oracle of every attention variant against an independent computation.

The reference materialises the whole score matrix in float64, applies softcap and ALiBi from
global positions, then the brute-force mask. The sink is one more logit column of value zero.
Softmax, drop the column; the backward is autograd's, d(sinks) included. Each variant alone and
all together, with GQA, masks, a value head dim smaller and larger, rows that see no key, tiles
that do and do not divide the length, and W = 1..4 shares of uneven splits. Measured agreement:
~1e-15; the bound is 1e-12. The base errs a little, never zero, in bf16 and fp16.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import inputs
from harness.case import make_case
from harness.oracle import assemble
from harness.oracle.variant import PLAIN, TileVariant, variant_of
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec
from ring_impl.variants import alibi_slopes
from tests.helpers.masks import brute

N = 17
FIELDS = ("out", "lse", "dq", "dk", "dv")
VARIANTS = {
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=(0.0, 2.5, -1.0, 7.0)),
    "dv-small": dict(dim_v=3),
    "dv-large": dict(dim_v=20),
    "all": dict(softcap=4.0, alibi=True, sinks=(1.0, 3.5, -2.0, 5.0), dim_v=11),
}


def reference(
    q, k, v, dout, mask: torch.Tensor, scale: float, softcap=None, alibi=False, sinks=None
):
    """(out, lse, dq, dk, dv, dsinks) in float64 by autograd; dsinks None without sinks."""
    q, k, v = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    b, n, hq, _ = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    kv_of = [h // (hq // hkv) for h in range(hq)]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k[:, :, kv_of]) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi:
        slopes = torch.tensor(alibi_slopes(hq), dtype=torch.float32).double().view(hq, 1, 1)
        s = s - slopes * (torch.arange(n).view(-1, 1) - torch.arange(nk).view(1, -1)).abs()
    s = s.masked_fill(~mask, -math.inf)
    sk = None
    if sinks is not None:
        sk = torch.tensor(sinks, dtype=torch.float32).double().requires_grad_(True)
        s = torch.cat([s, sk.view(1, hq, 1, 1).expand(b, hq, n, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num()  # a row with no key and no sink: 0
    if sinks is not None:
        p = p[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v[:, :, kv_of])
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, None if sk is None else sk.grad


def _inputs(seed: int, hq: int, hkv: int, dim_v: int):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, N, hq, 8, generator=g), torch.randn(2, N, hkv, 8, generator=g)
    v, dout = torch.randn(2, N, hkv, dim_v, generator=g), torch.randn(2, N, hq, dim_v, generator=g)
    return q, k, v, dout


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float64 and got.shape == want.shape, what
    same_inf = torch.isinf(want) & (got == want)
    err = torch.where(same_inf, torch.zeros_like(want), (got - want).abs())
    assert float(err.max()) < 1e-12, (what, float(err.max()))


MASKS = [
    MaskSpec("causal"),
    MaskSpec("window", window=2),
    MaskSpec("document", doc_starts=(0, 5, 6, 12), causal=False),
]


@pytest.mark.parametrize("block", [1024, 6])  # one tile; tiles that do not divide N
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_matches_an_independent_float64_computation(monkeypatch, name, block):
    monkeypatch.setattr(assemble, "BLOCK", block)
    kw = dict(VARIANTS[name])
    dim_v = kw.pop("dim_v", 8)
    var = TileVariant.make(4, **kw)
    for i, spec in enumerate(MASKS):
        q, k, v, dout = _inputs(7 * block + len(name) + i, 4, 2, dim_v)
        mask = torch.tensor([[brute(spec, i, j) for j in range(N)] for i in range(N)])
        exact = assemble.attention(q, k, v, dout, spec, 0.37, torch.float64, variant=var)
        want = reference(q, k, v, dout, mask, 0.37, **kw)
        for f, w in zip(FIELDS, want, strict=False):
            _close(getattr(exact, f), w, f"{spec.kind} {f}")
        assert exact.out.shape[-1] == exact.dv.shape[-1] == dim_v and exact.dq.shape[-1] == 8
        if "sinks" in kw:
            _close(exact.dsinks, want[5].view(1, -1), f"{spec.kind} dsinks")
            assert set(exact.term_scale["dsinks"]) == {"terms", "D", "dout"}
        else:
            assert exact.dsinks is None and "dsinks" not in exact.term_scale


def test_rows_that_see_no_key_get_the_sink_alone(monkeypatch):
    """out 0, lse = sink_h, dq 0 and no NaN, where the mask leaves a row (or a block of rows)
    nothing; the other rows as the reference has them."""
    from harness.oracle import tiles

    mask = torch.ones(N, N, dtype=torch.bool).tril()
    mask[3] = False
    mask[8:12] = False
    monkeypatch.setattr(tiles, "allowed", lambda spec, qp, kp: mask[qp][:, kp])
    monkeypatch.setattr(assemble, "BLOCK", 4)
    kw = dict(softcap=2.0, alibi=True, sinks=(0.5, -3.0, 9.0, 2.0))
    q, k, v, dout = _inputs(3, 4, 1, 6)
    var = TileVariant.make(4, **kw)
    want = reference(q, k, v, dout, mask, 0.5, **kw)
    exact, base = assemble.attention_pair(q, k, v, dout, None, 0.5, torch.bfloat16, variant=var)
    empty = [3, 8, 9, 10, 11]
    sinks = torch.tensor(kw["sinks"], dtype=torch.float64).view(1, 4, 1)
    for r in (exact, base):
        assert not any(getattr(r, f).isnan().any() for f in FIELDS) and not r.dsinks.isnan().any()
        assert (r.out[:, empty] == 0).all() and (r.dq[:, empty] == 0).all()
        assert torch.equal(r.lse[:, :, empty].double(), sinks.expand(2, 4, len(empty)))
    for f, w in zip(FIELDS, want, strict=False):
        _close(getattr(assemble.attention(q, k, v, dout, None, 0.5, torch.float64, var), f), w, f)


SHARE_CASES = [
    dict(world_size=1, seq_lens=(13,), mask={"kind": "causal"}),
    dict(world_size=2, seq_lens=(9, 4), layout="zigzag", mask={"kind": "window", "window": 3}),
    dict(world_size=3, seq_lens=(2, 11, 5), layout="striped", mask={"kind": "none"}),
    dict(
        world_size=4,
        seq_lens=(6, 0, 7, 4),
        mask={"kind": "document", "doc_starts": [0, 4, 12], "causal": True},
    ),
]


@pytest.mark.parametrize("fields", SHARE_CASES, ids=lambda f: f"W{f['world_size']}")
def test_each_share_gets_the_dsinks_of_its_own_rows(fields):
    """The shares of a case with every variant: the assembled exact outputs, and each share's
    dsinks, the reference's gradient with dout kept on that share's rows only (it is linear in
    dout). ALiBi's bias comes from global positions, whatever the layout."""
    case = make_case(
        heads_q=4,
        heads_kv=2,
        head_dim=8,
        head_dim_v=5,
        softcap=3.0,
        alibi=True,
        sinks=(0.3, 2.0, 4.5, -1.0),
        seed=21,
        **fields,
    )
    g = inputs.make_global(case)
    n = case.total_len
    mask = torch.tensor([[brute(case.mask, i, j) for j in range(n)] for i in range(n)])
    kw = dict(softcap=3.0, alibi=True, sinks=case.sinks)
    exact, _ = assemble.local(case)
    want = reference(g["q"], g["k"], g["v"], g["dout"], mask, case.scale, **kw)
    for f, w in zip(FIELDS, want, strict=False):
        _close(getattr(exact, f), w, f)
    assert exact.dsinks.shape == (case.world_size, 4)
    for share, pos in enumerate(all_positions(case.layout, case.seq_lens)):
        keep = torch.zeros(1, n, 1, 1)
        keep[:, pos] = 1
        part = reference(g["q"], g["k"], g["v"], g["dout"] * keep, mask, case.scale, **kw)[5]
        _close(exact.dsinks[share], part, f"dsinks of share {share}")
    _close(exact.dsinks.sum(0), want[5], "dsinks summed over the shares")
    # the term scales: each share's largest head's sum of P_sink |D| and P_sink |dout|_1, added
    # up over the shares (the judged dsinks is the ranks' sum)
    p_sink = (torch.tensor(case.sinks).view(1, -1, 1) - want[1]).exp().transpose(1, 2)  # B N H
    delta = (g["dout"].double() * want[0]).sum(-1)
    l1 = g["dout"].double().abs().sum(-1)
    for name, t in (("terms", delta.abs()), ("dout", l1)):
        top = sum(
            float((p_sink * t)[:, pos].sum(dim=(0, 1)).max())
            for pos in all_positions(case.layout, case.seq_lens)
        )
        assert math.isclose(exact.term_scale["dsinks"][name], top, rel_tol=1e-9), name


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_base_errs_a_little_and_never_zero_for_every_variant(dtype):
    """The base is plain attention in the dtype: its error against exact is a few units of the
    dtype at the terms' scale, and above 0 on every tensor (it is the rule's measured sample)."""
    case = make_case(
        world_size=2,
        total_len=24,
        mask={"kind": "causal"},
        heads_q=4,
        heads_kv=2,
        head_dim=16,
        head_dim_v=8,
        softcap=5.0,
        alibi=True,
        sinks=(0.0, 3.0, 5.0, 1.0),
        dtype=dtype,
        seed=5,
    )
    exact, base = assemble.local(case)
    u = {"bf16": 2.0**-8, "fp16": 2.0**-11}[dtype]
    for f in (*FIELDS, "dsinks"):
        err = float((getattr(base, f).double() - getattr(exact, f)).abs().max())
        scale = max(exact.term_scale.get(f, {"x": float(getattr(exact, f).abs().max())}).values())
        assert 0 < err < 40 * u * max(scale, 1.0), (f, err, scale)


def test_a_plain_case_has_no_sink_term_and_the_plain_variant():
    case = make_case(world_size=2, total_len=10, mask={"kind": "causal"}, seed=1)
    assert variant_of(case) == PLAIN and PLAIN.plain_scores and PLAIN.sinks is None
    exact, base = assemble.local(case)
    assert exact.dsinks is None and base.dsinks is None and "dsinks" not in exact.term_scale
    assert TileVariant.make(4, sinks=(0.1,) * 4).sinks == (float(torch.tensor(0.1)),) * 4
