"""Rows that see nothing and ranks that hold nothing, through the oracle, the judge and the leak
check: out = 0, lse = -inf, dq = 0, dk = dv = 0 for keys no query sees, never NaN; the oracle's -inf
against result -inf is a match, anything else there (+inf, NaN, a finite value) is not."""

from __future__ import annotations

import pytest
import torch

from harness.case import make_case
from harness.judging.tensor_checks import check_leak, check_tensors
from harness.oracle.cache import outputs
from ring_impl.layouts import all_positions
from ring_impl.mask_eval import empty_rows, visible_keys

# dilated(8, 2, 1): queries off the dilation grid (even offsets in a segment) see nothing; the
# second rank of three holds no token at all (an idle rank)
CASES = [
    make_case(
        world_size=3,
        seq_lens=(9, 0, 11),
        mask={"kind": "dilated", "segment": 8, "rate": 2, "offset": 1},
        heads_q=4,
        heads_kv=2,
    ),
    make_case(world_size=2, seq_lens=(7, 6), layout="zigzag", mask={"not": {"kind": "causal"}}),
    make_case(
        world_size=4,
        seq_lens=(0, 6, 0, 9),
        layout="striped",
        mask={"and": [{"kind": "prefix", "length": 4}, {"kind": "inverse-causal"}]},
    ),
]


def _shards(case, exact):
    return {
        r: {
            n: (getattr(exact, n).index_select(2 if n == "lse" else 1, pos).clone()).float()
            for n in ("out", "lse", "dq", "dk", "dv")
        }
        for r, pos in enumerate(all_positions(case.layout, case.seq_lens))
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.summary())
def test_oracle_gives_zero_rows_and_minus_inf_lse_never_nan(case):
    exact, base = outputs(case)
    empty = empty_rows(case.mask, case.total_len)
    # the case has rows that see nothing, and rows that see something
    assert empty.any() and not empty.all()
    for r in (exact, base):
        for n in ("out", "dq", "dk", "dv"):
            assert not getattr(r, n).isnan().any(), n
        assert bool((r.out[:, empty] == 0).all()) and bool((r.dq[:, empty] == 0).all())
        assert bool((r.lse[:, :, empty] == float("-inf")).all())
        assert bool(torch.isfinite(r.lse[:, :, ~empty]).all())
    unseen = ~visible_keys(case.mask, torch.arange(case.total_len), case.total_len)
    assert bool((exact.dk[:, unseen] == 0).all()) and bool((exact.dv[:, unseen] == 0).all())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.summary())
def test_judge_matches_minus_inf_and_fails_plus_inf_or_nan(case):
    exact, base = outputs(case)
    checks = check_tensors(case, _shards(case, exact), exact, base)
    assert checks and all(c.passed for c in checks)
    # a -inf lse sets no scale: the bound stays finite
    assert all(c.allowed < float("inf") for c in checks)
    empty = empty_rows(case.mask, case.total_len)
    pos_all = all_positions(case.layout, case.seq_lens)
    rank = next(r for r, p in enumerate(pos_all) if bool(empty[p].any()))
    row = int(empty[pos_all[rank]].nonzero()[0])
    for name, value, kind in (
        ("lse", float("inf"), "+inf"),
        ("out", float("nan"), "NaN"),
        ("lse", 0.0, ""),
    ):
        shards = _shards(case, exact)
        if name == "lse":
            shards[rank]["lse"][0, 0, row] = value
        else:
            shards[rank]["out"][0, row, 0, 0] = value
        bad = [c for c in check_tensors(case, shards, exact, base) if not c.passed]
        assert [(c.tensor, c.rank) for c in bad] == [(name, rank)], (name, value)
        assert bad[0].nonfinite_kinds == kind


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.summary())
def test_leak_check_with_empty_rows_and_idle_ranks(case):
    from harness import inputs

    queries = inputs.leak_queries(case)
    seen = visible_keys(case.mask, queries, case.total_len)
    pos_all = all_positions(case.layout, case.seq_lens)

    def grads(extra_key=None):
        out = {}
        for r, pos in enumerate(pos_all):
            g = (
                seen[pos]
                .to(torch.float32)
                .view(1, -1, 1, 1)
                .expand(1, pos.numel(), case.heads_kv, 3)
                .clone()
            )
            if extra_key is not None and extra_key in pos.tolist():
                g[0, pos.tolist().index(extra_key), 0, 0] = 1e-30
            out[r] = {"dk": g, "dv": g.clone()}
        return out

    leak = check_leak(case, grads())
    assert leak is not None and leak.passed and leak.hidden_keys == int((~seen).sum())
    hidden = (~seen).nonzero().view(-1)
    assert hidden.numel()
    leak = check_leak(case, grads(int(hidden[-1])))
    assert not leak.passed and leak.leaks[0]["token"] == int(hidden[-1])


def test_a_rank_whose_rows_all_see_nothing_gets_its_oracle_share():
    """prefix(7) & inverse-causal: only queries 0-6 see keys, so ranks 2 and 3 (rows 7-26) see
    nothing at all and rank 1 holds no token; each rank's share is 0 / -inf, never NaN or an
    error."""
    from harness.oracle.parts import gather_stats
    from harness.oracle.shares import share_keys, share_rows

    case = make_case(
        world_size=4,
        seq_lens=(7, 0, 11, 9),
        mask={"and": [{"kind": "prefix", "length": 7}, {"kind": "inverse-causal"}]},
    )
    rows = {rank: share_rows(case, rank) for rank in range(4)}
    for rank, (exact, base) in rows.items():
        for s in (exact, base):
            assert not s.out.isnan().any() and not s.dq.isnan().any() and not s.delta.isnan().any()
        if rank >= 2:
            assert bool((exact.out == 0).all()) and bool((exact.lse == float("-inf")).all())
            assert bool((exact.dq == 0).all())
    stats = tuple(gather_stats([rows[r][d] for r in range(4)], case.total_len) for d in (0, 1))
    for rank in range(4):
        for s in share_keys(case, rank, stats):
            assert not s.dk.isnan().any() and not s.dv.isnan().any()
            if rank >= 2:  # keys 7-26: no query sees them
                assert bool((s.dk == 0).all()) and bool((s.dv == 0).all())
