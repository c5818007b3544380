"""Each block's own error (harness.diagnose.split): the references under the ring's own lse.

Under the exact statistics they are the exact split; under a ring's lse, a block the ring computed
right matches its reference, whatever the other blocks did.
"""

from __future__ import annotations

import torch

from harness import inputs
from harness.case import make_case
from harness.diagnose import localise, split
from harness.oracle.assemble import attention


def _exact(c, keep_v=None):
    g = inputs.make_global(c)
    v = g["v"] if keep_v is None else g["v"] * keep_v
    return g, attention(g["q"], g["k"], v, g["dout"], c.mask, c.scale, compute=torch.float64)


def test_key_grads_under_the_exact_statistics_are_the_exact_split():
    """GQA, zigzag, causal: dout kept on each query block in turn; the blocks sum to dk and dv."""
    c = make_case(
        world_size=3, seq_lens=(4, 2, 4), layout="zigzag", mask={"kind": "causal"}, heads_q=4
    )
    assert c.heads_kv < c.heads_q
    g, exact = _exact(c)
    lse, renormalised = split.row_lse(exact.lse, None)
    assert not renormalised
    stats = split.RowStats(lse, split.row_delta(exact.out, g["dout"], None))
    parts = [split.key_grads(c, g, stats, b) for b in range(3)]
    for i, name in enumerate(("dk", "dv")):
        total = sum(p[i] for p in parts)
        torch.testing.assert_close(total, getattr(exact, name), rtol=0, atol=1e-12)
    own = localise.owners(c)
    for b in range(3):  # one block against the oracle with dout kept on it
        keep = (own == b).view(1, -1, 1, 1)
        kept = attention(
            g["q"], g["k"], g["v"], g["dout"] * keep, c.mask, c.scale, compute=torch.float64
        )
        torch.testing.assert_close(parts[b][1], kept.dv, rtol=0, atol=1e-12)


def test_a_block_dropped_by_a_ring_leaves_the_others_right_under_its_lse():
    """A ring that drops key block 0 for every query: its lse is the log-sum over the rest, and
    its output with V kept on block 1 or 2 matches that block's reference. Against the exact
    split those right blocks show error; block 0 (where the ring gives 0) is the one off."""
    c = make_case(world_size=3, seq_lens=(3, 3, 3), mask={"kind": "none"}, heads_q=2, heads_kv=2)
    own = localise.owners(c)
    g = inputs.make_global(c)
    s = torch.einsum("bqhd,bkhd->bhqk", g["q"].double(), g["k"].double()) * c.scale
    ring_lse = torch.logsumexp(s[..., own != 0], dim=-1)
    lse, renormalised = split.row_lse(_exact(c)[1].lse, ring_lse)
    assert renormalised
    for b in range(3):
        exact_b = _exact(c, (own == b).view(1, -1, 1, 1))[1]
        ref = split.out_reference(exact_b.out, exact_b.lse, lse)
        p = (s - ring_lse.unsqueeze(-1)).exp() * (own == b) * (b != 0)
        ring_b = torch.einsum("bhqk,bkhd->bqhd", p, g["v"].double())
        off = float((ring_b - ref).abs().max())
        raw = float((ring_b - exact_b.out.double()).abs().max())
        if b == 0:
            assert off > 1e-2, off
        else:
            assert off < 1e-6 < 1e-2 < raw, (off, raw)
