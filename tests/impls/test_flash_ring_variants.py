"""flash-ring's attention variants (docs/case-model.md): softcap, ALiBi, sinks, head_dim_v.

On one process, against float64 autograd: the whole score matrix, softcap and ALiBi over global
positions, the sink as one more logit column with a zero value. Then on ranks, judged by the
harness against its oracle.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.case import make_case
from harness.impls.adapters import flash_ring
from ring_impl.masks import MaskSpec
from tests.helpers.contexts import make_ctx

B, N, HQ, HKV, D = 2, 13, 4, 2, 8
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
SINKS = torch.tensor([0.0, 2.5, 4.0, -1.0])  # zero, around a row's lse, above it, below it


def brute(q, k, v, pos, scale, vis, softcap=None, slopes=None, sinks=None):
    """(out, lse) in float64 by autograd-able ops; vis (N, N) says which keys a query sees."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        dist = (pos.view(-1, 1) - pos.view(1, -1)).abs().double()
        s = s - slopes.double().view(1, -1, 1, 1) * dist
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, *v.shape[2:])], dim=1)
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse.unsqueeze(-1)), v), lse


def _inputs(dv, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, N, h, D, generator=gen) * 2 for h in (HQ, HKV))
    v, dout = torch.randn(B, N, HKV, dv, generator=gen), torch.randn(B, N, HQ, dv, generator=gen)
    return q, k, v, dout


def _compare(spec, mask, dtype=torch.float32, atol=2e-5, vis=None):
    """Run flash-ring at W=1 on shuffled global positions; assert every tensor matches float64."""
    dv = spec.get("dv", D)
    q, k, v, dout = _inputs(dv)
    pos = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    sinks = SINKS.clone().requires_grad_() if spec.get("sinks") else None
    slopes = SLOPES if spec.get("alibi") else None
    ctx = dataclasses.replace(
        make_ctx(lengths=(N,), mask=mask, scale=D**-0.5),
        all_positions=(pos,),
        sinks=sinks,
        softcap=spec.get("softcap"),
        alibi_slopes=slopes,
        head_dim_v=None if dv == D else dv,
    )
    leaves = [t.to(dtype).detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_ring.make("flash-ring").run(*leaves, ctx)
    out.backward(dout.to(dtype))
    vis = flash_ring.visible(ctx, pos, pos) if vis is None else vis
    ref = [t.detach().to(dtype).double().requires_grad_() for t in (q, k, v)]
    rsinks = None if sinks is None else SINKS.double().requires_grad_()
    rout, rlse = brute(*ref, pos, D**-0.5, vis, spec.get("softcap"), slopes, rsinks)
    rout.backward(dout.to(dtype).double())
    got = [out, lse, *(t.grad for t in leaves)]
    want = [rout, rlse, *(t.grad for t in ref)]
    if sinks is not None:
        got, want = [*got, sinks.grad], [*want, rsinks.grad]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, rtol=atol, atol=atol, msg=name)
    return out, lse, leaves[0].grad


CASES = {
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "dv-smaller": dict(dv=4),
    "dv-larger": dict(dv=12),
    "all": dict(softcap=2.0, alibi=True, sinks=True, dv=12),
    "all-dv-smaller": dict(softcap=2.0, alibi=True, sinks=True, dv=4),
}
MASKS = {"none": MaskSpec("none"), "causal": MaskSpec("causal")}


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    # several tiles per block: softcap, ALiBi and the sink go through the online softmax
    monkeypatch.setattr(flash_ring, "KEY_TILE", 4)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", CASES)
def test_one_rank_matches_float64_autograd(name, mask):
    _compare(CASES[name], MASKS[mask])


def test_bf16_with_every_variant_stays_near_float64():
    _compare(CASES["all"], MASKS["causal"], dtype=torch.bfloat16, atol=0.1)


def test_a_row_that_sees_no_key_but_a_sink_gets_out_0_lse_sink_and_dq_0(monkeypatch):
    hidden = torch.zeros(N, dtype=torch.bool)
    hidden[[0, 5]] = True  # two query rows see no key at all

    def fewer(ctx, q_pos, k_pos):
        return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool) & ~hidden.view(-1, 1)

    monkeypatch.setattr(flash_ring, "visible", fewer)
    vis = fewer(None, torch.arange(N), torch.arange(N))
    out, lse, dq = _compare(CASES["all"], MASKS["none"], vis=vis)
    assert torch.equal(out[:, hidden], torch.zeros_like(out[:, hidden]))
    assert torch.equal(lse[:, :, hidden], SINKS.view(1, -1, 1).expand(B, HQ, 2))
    assert torch.equal(dq[:, hidden], torch.zeros_like(dq[:, hidden]))


def test_declares_the_four_variants():
    caps = flash_ring.make("flash-ring").capabilities
    assert caps.variants == {"sinks", "softcap", "alibi", "head_dim_v"}


POOL_SIZE = 3  # ranks of the module's `pool` (tests/conftest.py)


@pytest.mark.parametrize(
    "kw",
    [
        dict(world_size=2, layout="zigzag", mask={"kind": "causal"}, head_dim_v=12),
        dict(world_size=3, seq_lens=(5, 0, 6), layout="contiguous", head_dim_v=4, dtype="bf16"),
        dict(world_size=3, layout="striped", mask={"kind": "causal"}, heads_q=4, heads_kv=1),
    ],
    ids=["w2-zigzag-dv-larger", "w3-idle-dv-smaller-bf16", "w3-striped-mqa"],
)
def test_on_ranks_every_variant_passes_the_harness(pool, kw):
    from harness.runner import run_case

    fields = {"heads_q": 2, "heads_kv": 2, "head_dim": 8, "total_len": 11, **kw}
    if "seq_lens" in fields:
        del fields["total_len"]
    sinks = [0.0, 2.5, 4.0, 1.0][: fields["heads_q"]]
    c = make_case(seed=7, sinks=sinks, softcap=2.0, alibi=True, **fields)
    r = run_case(c, pool, "flash-ring")
    assert r.verdict == "pass", r.detail + str([(ch.tensor, ch.ratio) for ch in r.failed_checks()])
