"""Issue #12: the oracle computed by the ranks, each for its own query rows, equals the local oracle bit for
bit (same shares, same blocks, assembled in the same rank order), on every battery case, every tensor,
every rank's share; a query that sees no key gets out = 0, lse = -inf, dq = 0 and no NaN anywhere."""

from __future__ import annotations

import math

import pytest
import torch

from harness.case import make_case
from harness.judging import oracle
from harness.ranks import reference
from harness.ranks.pool import RankPool
from harness.result import Verdict
from harness.runner import oracle_deadline, oracle_mode, run_case
from harness.search.battery import default_battery

FIELDS = ("out", "lse", "dq", "dk", "dv")


@pytest.fixture(scope="module")
def pool():
    with RankPool(8) as p:
        yield p


def _same_share(a: reference.Share, b: reference.Share, what: str) -> None:
    assert torch.equal(a.rows, b.rows), what
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {f}"
    if a.terms is not None:
        for f in ("col_ds", "col_pa", "col_p"):
            assert torch.equal(getattr(a.terms, f), getattr(b.terms, f)), f"{what}: {f}"
        for f in ("out", "dq", "dq_d", "max_q", "max_k", "max_dout"):
            assert getattr(a.terms, f) == getattr(b.terms, f), f"{what}: {f}"


def _same_reference(a: oracle.Reference, b: oracle.Reference, what: str) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {f}"
    assert a.term_scale == b.term_scale, what


def test_the_ranks_oracle_equals_the_local_oracle_on_the_battery(pool):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: one thread
    try:
        for i, case in enumerate(default_battery(4)):
            pool.ensure(case.pool_size)
            got = pool.oracle(case, oracle_deadline(case))
            assert sorted(got) == list(range(case.world_size)), case.summary()
            for g in range(case.world_size):
                want = reference.share(case, g)
                _same_share(got[g][0], want[0], f"case {i} rank {g} float64")
                _same_share(got[g][1], want[1], f"case {i} rank {g} base")
            ref, base = oracle.local(case)
            _same_reference(oracle.assemble(case, [got[g][0] for g in range(case.world_size)]), ref, f"case {i}")
            _same_reference(oracle.assemble(case, [got[g][1] for g in range(case.world_size)]), base, f"case {i}")
    finally:
        torch.set_num_threads(threads)


def test_a_case_judged_with_either_oracle_gets_the_same_checks(pool):
    case = make_case(world_size=4, total_len=61, layout="zigzag", mask={"kind": "causal"}, heads_q=4, heads_kv=2,
                     dtype="bf16", head_dim=32, seed=77)
    results = {}
    for mode in ("ranks", "local"):
        oracle._CACHE.clear()
        with oracle_mode(mode):
            results[mode] = run_case(case, pool)
    a, b = results["ranks"], results["local"]
    assert a.verdict == b.verdict == Verdict.PASS
    assert [(c.tensor, c.rank, c.allowed) for c in a.checks] == [(c.tensor, c.rank, c.allowed) for c in b.checks]
    assert a.timings["oracle_share_s"] > 0 and b.timings["oracle_share_s"] == 0


def test_the_shares_partition_the_rows_and_sum_to_the_global_oracle():
    """Against one global computation of the same oracle (other blocks, one share): equal to float64 rounding."""
    case = make_case(world_size=3, total_len=40, layout="striped", mask={"kind": "window", "window": 6},
                     heads_q=4, heads_kv=2, seed=3)
    from harness import inputs

    g = inputs.make_global(case)
    whole = oracle.attention(g["q"], g["k"], g["v"], g["dout"], case.mask, case.scale, torch.float64)
    ref, _ = oracle.local(case)
    for f in FIELDS:
        torch.testing.assert_close(getattr(ref, f), getattr(whole, f), rtol=1e-12, atol=1e-12)
    for t, classes in whole.term_scale.items():
        for c, v in classes.items():
            assert math.isclose(ref.term_scale[t][c], v, rel_tol=1e-12), (t, c)


def _hand_mask(n: int) -> torch.Tensor:
    """Causal, except queries 3 and 8..11 (a whole block of 4) see no key at all and key 11 is seen by no query."""
    m = torch.ones(n, n, dtype=torch.bool).tril()
    m[3] = False
    m[8:12] = False
    m[:, 11] = False
    return m


@pytest.mark.parametrize("compute", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block", [4, 64])
def test_queries_that_see_no_key(monkeypatch, compute, block):
    n = 16
    mask = _hand_mask(n)
    monkeypatch.setattr(reference, "allowed", lambda spec, qp, kp: mask[qp][:, kp])
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(2, n, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 8, generator=g) for _ in range(2))
    s = reference.attend(q, k, v, dout, torch.arange(n), None, 0.3, compute, block, terms=True)
    dk, dv = s.dk.to(compute), s.dv.to(compute)
    for name, t in (("out", s.out), ("lse", s.lse), ("dq", s.dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), name
    empty = [3, 8, 9, 10, 11]
    assert (s.out[:, empty] == 0).all() and (s.dq[:, empty] == 0).all()
    assert (s.lse[:, :, empty] == float("-inf")).all() and torch.isfinite(s.lse[:, :, [0, 1, 2, 4, 15]]).all()
    assert (dk[:, 11] == 0).all() and (dv[:, 11] == 0).all()
    assert (dk[:, 10] != 0).any() and (s.out[:, 4] != 0).any()
    if compute == torch.float64:  # the empty rows change nothing else: same as attention without them
        keep = [i for i in range(n) if i not in empty]
        monkeypatch.setattr(reference, "allowed", lambda spec, qp, kp: mask[keep][:, :][qp][:, kp])
        r = reference.attend(q[:, keep], k, v, dout[:, keep], torch.arange(len(keep)), None, 0.3, compute, block)
        torch.testing.assert_close(s.out[:, keep], r.out, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(s.dk, r.dk, rtol=1e-14, atol=1e-14)


def test_an_oracle_past_its_deadline_is_the_harness_error_and_the_pool_recovers(pool):
    from harness.errors import PoolError

    case = make_case(world_size=2, total_len=2048, layout="zigzag", mask={"kind": "causal"}, heads_q=8, heads_kv=8,
                     head_dim=64, seed=9)
    pool.ensure(2)
    with pytest.raises(PoolError, match=r"the oracle of W2 .*passed its deadline of 0 s"):
        pool.oracle(case, 0.001)
    assert pool.broken  # the late shares are still on their way: the next case starts fresh ranks
    small = make_case(world_size=2, total_len=16, mask={"kind": "causal"}, seed=9)
    assert run_case(small, pool).verdict == Verdict.PASS
