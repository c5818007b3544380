"""Issue #12: the oracle computed by the ranks, each for its own positions in two passes (its query
rows against every key, then its keys against every query), equals the local oracle bit for bit
(same shares, same tiles, assembled the same way), on every battery case, every tensor, every rank's
parts; no pass holds more than one block of positions that are not its share's (memory ~1/W); a
query that sees no key gets out = 0, lse = -inf, dq = 0 and no NaN anywhere."""

from __future__ import annotations

import math

import pytest
import torch

from harness.case import make_case
from harness.oracle import assemble, cache, shares, tiles
from harness.oracle.mode import oracle_deadline, oracle_mode
from harness.oracle.parts import KeysPart, RowsPart, gather_stats
from harness.result import Verdict
from harness.runner import run_case
from harness.search.battery import default_battery

FIELDS = ("out", "lse", "dq", "dk", "dv")
ROWS_FIELDS = ("rows", "out", "lse", "dq", "mx", "total", "delta", "amp", "dsinks")
KEYS_FIELDS = ("keys", "dk", "dv")


POOL_SIZE = 8  # ranks of the module's `pool` (tests/conftest.py)


def _same(a, b, fields, what: str) -> None:
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        if x is None or y is None:
            assert x is None and y is None, f"{what}: {f}"
            continue
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {f}"


def _same_rows(a: RowsPart, b: RowsPart, what: str) -> None:
    _same(a, b, ROWS_FIELDS, what)
    assert a.maxima == b.maxima, what


def _same_keys(a: KeysPart, b: KeysPart, what: str) -> None:
    _same(a, b, KEYS_FIELDS, what)
    assert a.cols.keys() == b.cols.keys() and a.max_k == b.max_k, what
    for name in a.cols:
        assert torch.equal(a.cols[name], b.cols[name]), f"{what}: column sums {name}"


def _same_outputs(a: assemble.OracleOutputs, b: assemble.OracleOutputs, what: str) -> None:
    _same(a, b, (*FIELDS, "dsinks"), what)
    assert a.term_scale == b.term_scale, what


def _ranks_equal_local(pool, case, what: str) -> None:
    """Every rank's parts of both passes, and the assembled outputs, equal the local oracle's."""
    pool.ensure(case.pool_size)
    world_size = range(case.world_size)
    rows = pool.oracle(case, oracle_deadline(case, "rows"), "rows")
    assert sorted(rows) == list(world_size), case.summary()
    for g in world_size:
        want = shares.share_rows(case, g)
        _same_rows(rows[g][0], want[0], f"{what} rank {g} float64 rows")
        _same_rows(rows[g][1], want[1], f"{what} rank {g} base rows")
    stats = tuple(gather_stats([rows[g][d] for g in world_size], case.total_len) for d in (0, 1))
    keys = pool.oracle(case, oracle_deadline(case, "keys"), "keys", stats)
    for g in world_size:
        want = shares.share_keys(case, g, stats)
        _same_keys(keys[g][0], want[0], f"{what} rank {g} float64 keys")
        _same_keys(keys[g][1], want[1], f"{what} rank {g} base keys")
    exact, base = assemble.local(case)
    for d, whole in enumerate((exact, base)):
        got = assemble.assemble(
            case.total_len,
            case.scale,
            [rows[g][d] for g in world_size],
            [keys[g][d] for g in world_size],
        )
        _same_outputs(got, whole, f"{what} {'float64' if d == 0 else 'base'}")


def test_the_ranks_oracle_equals_the_local_oracle_on_the_battery(pool):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: one thread
    try:
        for i, case in enumerate(default_battery(4)):
            _ranks_equal_local(pool, case, f"case {i}")
    finally:
        torch.set_num_threads(threads)


def test_the_ranks_oracle_equals_the_local_oracle_with_every_variant(pool):
    """Issue #53: softcap, ALiBi, sinks and a value head dim of its own, together, on uneven
    shares; each rank's dsinks travels in its rows part."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fields = dict(heads_q=4, heads_kv=2, head_dim=8, softcap=20.0, alibi=True, seed=6)
    cases = [
        make_case(
            world_size=3,
            seq_lens=(11, 4, 9),
            layout="zigzag",
            mask={"kind": "causal"},
            head_dim_v=12,
            sinks=(0.0, 3.2, 5.0, -1.5),
            dtype="bf16",
            **fields,
        ),
        make_case(
            world_size=2,
            seq_lens=(7, 10),
            layout="striped",
            mask={"kind": "window", "window": 4},
            head_dim_v=4,
            sinks=(1.0, 2.0, 3.0, 4.0),
            dtype="fp16",
            **fields,
        ),
    ]
    try:
        for i, case in enumerate(cases):
            _ranks_equal_local(pool, case, f"variant case {i}")
            assert shares.share_rows(case, 0)[0].dsinks.shape == (4,)
    finally:
        torch.set_num_threads(threads)


def test_a_case_judged_with_either_oracle_gets_the_same_checks(pool):
    case = make_case(
        world_size=4,
        total_len=61,
        layout="zigzag",
        mask={"kind": "causal"},
        heads_q=4,
        heads_kv=2,
        dtype="bf16",
        head_dim=32,
        seed=77,
    )
    results = {}
    for mode in ("ranks", "local"):
        cache.clear()
        with oracle_mode(mode):
            results[mode] = run_case(case, pool)
    a, b = results["ranks"], results["local"]
    assert a.verdict == b.verdict == Verdict.PASS
    assert [(c.tensor, c.rank, c.allowed) for c in a.checks] == [
        (c.tensor, c.rank, c.allowed) for c in b.checks
    ]
    assert a.timings["oracle_share_s"] > 0 and b.timings["oracle_share_s"] == 0


def test_the_shares_partition_the_rows_and_sum_to_the_global_oracle():
    """Against one global computation of the same oracle (other blocks, one share): equal to float64
    rounding."""
    case = make_case(
        world_size=3,
        total_len=40,
        layout="striped",
        mask={"kind": "window", "window": 6},
        heads_q=4,
        heads_kv=2,
        seed=3,
    )
    from harness import inputs

    g = inputs.make_global(case)
    whole = assemble.attention(
        g["q"], g["k"], g["v"], g["dout"], case.mask, case.scale, torch.float64
    )
    exact, _ = assemble.local(case)
    for f in FIELDS:
        torch.testing.assert_close(getattr(exact, f), getattr(whole, f), rtol=1e-12, atol=1e-12)
    for t, classes in whole.term_scale.items():
        for c, v in classes.items():
            assert math.isclose(exact.term_scale[t][c], v, rel_tol=1e-12), (t, c)


def _hand_mask(n: int) -> torch.Tensor:
    """Causal, except queries 3 and 8..11 (a whole block of 4) see no key at all and key 11 is seen
    by no query."""
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
    monkeypatch.setattr(tiles, "allowed", lambda spec, qp, kp: mask[qp][:, kp])
    monkeypatch.setattr(assemble, "BLOCK", block)
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(2, n, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 8, generator=g) for _ in range(2))
    s = assemble.attention(q, k, v, dout, None, 0.3, compute)
    for name in FIELDS:
        assert not getattr(s, name).isnan().any(), name
    empty = [3, 8, 9, 10, 11]
    assert (s.out[:, empty] == 0).all() and (s.dq[:, empty] == 0).all()
    assert (s.lse[:, :, empty] == float("-inf")).all() and torch.isfinite(
        s.lse[:, :, [0, 1, 2, 4, 15]]
    ).all()
    assert (s.dk[:, 11] == 0).all() and (s.dv[:, 11] == 0).all()
    assert (s.dk[:, 10] != 0).any() and (s.out[:, 4] != 0).any()
    # the empty rows change nothing else: same as attention without them
    if compute == torch.float64:
        keep = [i for i in range(n) if i not in empty]
        monkeypatch.setattr(tiles, "allowed", lambda spec, qp, kp: mask[keep][qp][:, kp])
        r = assemble.attention(q[:, keep], k, v, dout[:, keep], None, 0.3, compute)
        torch.testing.assert_close(s.out[:, keep], r.out, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(s.dk, r.dk, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(s.dv, r.dv, rtol=1e-14, atol=1e-14)


# the variants of issue #53 keep the plan: softcap, ALiBi, sinks and a wider value head dim
VARIANT_FIELDS = dict(softcap=5.0, alibi=True, sinks=(1.0, 2.0, 3.0, 4.0), head_dim_v=24)


@pytest.mark.parametrize(
    "layout, variants",
    [("contiguous", False), ("zigzag", False), ("striped", False), ("zigzag", True)],
)
def test_a_share_never_holds_more_than_one_block_of_other_positions(monkeypatch, layout, variants):
    """The memory claim, checked by what the passes make: past WHOLE_INPUTS_BYTES (here 0) every
    input a pass generates from the seed is either the share's own positions or at most one tile
    side of others', and what it returns has the share's size (plus B x Hq statistics per token), so
    a share's memory falls ~1/W."""
    from harness import inputs

    case = make_case(
        world_size=4,
        total_len=103,
        layout=layout,
        mask={"kind": "causal"},
        heads_q=4,
        heads_kv=2,
        head_dim=8,
        dtype="bf16",
        seed=11,
        **(VARIANT_FIELDS if variants else {}),
    )
    monkeypatch.setattr(tiles, "block", lambda c: 16)
    monkeypatch.setattr(shares, "WHOLE_INPUTS_BYTES", 0)
    made: list[tuple[str, int, bool]] = []
    real = inputs.make
    mine: set[int] = set()

    def counting(c, name, pos):
        made.append((name, pos.numel(), set(pos.tolist()) <= mine))
        return real(c, name, pos)

    monkeypatch.setattr(inputs, "make", counting)
    rows = {}
    for g in range(4):
        made.clear()
        mine = set(shares.positions(case, g).tolist())
        rows[g] = shares.share_rows(case, g)
        own = len(mine)
        assert made and all(size <= 16 for _, size, is_mine in made if not is_mine), made
        assert {name for name, size, is_mine in made if is_mine and size == own} == {"q", "dout"}
        for part in rows[g]:
            assert part.out.shape[1] == part.dq.shape[1] == own
    stats = tuple(gather_stats([rows[g][d] for g in range(4)], case.total_len) for d in (0, 1))
    for g in range(4):
        made.clear()
        mine = set(shares.positions(case, g).tolist())
        parts = shares.share_keys(case, g, stats)
        own = len(mine)
        assert made and all(size <= 16 for _, size, is_mine in made if not is_mine), made
        for part in parts:
            assert part.dk.shape[1] == part.dv.shape[1] == own
    for st in stats:  # the only whole-sequence tensors: B x Hq per token
        whole = [t for t in (st.mx, st.total, st.delta, st.amp) if t is not None]
        assert all(t.shape == (1, 4, case.total_len) for t in whole)


def test_a_small_case_makes_each_input_once_per_pass(monkeypatch):
    """Below WHOLE_INPUTS_BYTES a pass makes each whole input once (kept for the case's next pass)
    and indexes it: the same values as block by block (inputs are made per token), so the same parts
    bit for bit."""
    from harness import inputs

    case = make_case(
        world_size=3,
        total_len=100,
        layout="zigzag",
        mask={"kind": "window", "window": 9},
        heads_q=2,
        heads_kv=2,
        head_dim=8,
        dtype="fp16",
        seed=4,
    )
    monkeypatch.setattr(tiles, "block", lambda c: 16)
    monkeypatch.setitem(shares._WHOLE, "key", None)  # nothing kept from an earlier case
    calls = []
    real = inputs.make
    monkeypatch.setattr(
        inputs, "make", lambda c, name, pos: calls.append(name) or real(c, name, pos)
    )
    whole = shares.share_rows(case, 1)
    assert sorted(calls) == ["dout", "k", "q", "v"]
    calls.clear()
    monkeypatch.setattr(shares, "WHOLE_INPUTS_BYTES", 0)
    blockwise = shares.share_rows(case, 1)
    assert len(calls) > 4
    for a, b in zip(whole, blockwise, strict=True):
        _same_rows(a, b, "whole vs block by block")


def test_an_oracle_past_its_deadline_is_the_harness_error_and_the_pool_recovers(pool):
    from harness.errors import PoolError

    case = make_case(
        world_size=2,
        total_len=2048,
        layout="zigzag",
        mask={"kind": "causal"},
        heads_q=8,
        heads_kv=8,
        head_dim=64,
        seed=9,
    )
    pool.ensure(2)
    with pytest.raises(
        PoolError,
        match=r"the oracle \(rows pass\) of W2 .*passed its deadline of "
        r"0 s",
    ):
        pool.oracle(case, 0.001)
    assert pool.broken  # the late shares are still on their way: the next case starts fresh ranks
    small = make_case(world_size=2, total_len=16, mask={"kind": "causal"}, seed=9)
    assert run_case(small, pool).verdict == Verdict.PASS


@pytest.mark.parametrize("oracle", ["local", "whole"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_base_errs_like_plain_attention_under_autograd(dtype, oracle):
    """The split base (docs/oracle.md) rounds where one autograd graph of plain attention in the
    dtype does: with large logits (|s| ~ 350) its error against float64 stays within 2x of
    autograd's on every tensor. Were the two passes to form q.k differently (an ulp in fp32), P in
    the keys pass would be off by 350 ulps against the rows pass's normaliser: dv erred 25-60x
    autograd's that way. The one-pass base (`whole`, issue #55) too."""
    case = make_case(
        world_size=4,
        total_len=27,
        mask={"kind": "causal"},
        values="large",
        dtype=dtype,
        heads_q=2,
        heads_kv=2,
        head_dim=16,
    )
    from harness import inputs
    from harness.dtypes import TORCH_DTYPES

    g = inputs.make_global(case)
    q, k, v = (g[name].clone().requires_grad_(True) for name in "qkv")
    n = case.total_len
    s = (torch.einsum("bqhd,bkhd->bhqk", q, k) * case.scale).masked_fill(
        ~torch.ones(n, n).tril().bool(), -math.inf
    )
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1).to(TORCH_DTYPES[dtype]), v)
    out.backward(g["dout"])
    exact, base = getattr(assemble, oracle)(case)
    for name, plain in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        r = getattr(exact, name)
        err_plain = float((plain.detach().double() - r).abs().max())
        err_base = float((getattr(base, name).double() - r).abs().max())
        assert err_base <= 2 * err_plain + 1e-30, (name, err_base, err_plain)


def test_auto_computes_a_small_case_here_and_a_large_one_on_the_ranks(pool):
    """Issue #55: "auto", the default, saves a small case two round trips. A large case and a pool
    of GPU ranks keep the ranks' oracle. Verdicts and tolerances are those of the ranks' oracle: the
    same bits (the test above)."""
    from types import SimpleNamespace

    from harness.oracle.mode import SMALL_ORACLE, mode_for

    small = make_case(world_size=4, total_len=64, heads_q=4, heads_kv=2, head_dim=16, seed=3)
    n = int(math.isqrt(SMALL_ORACLE // (4 * 16))) + 1
    large = small.replace(seq_lens=(n // 4 + 1,) * 4)
    gpu = SimpleNamespace(backend="gloo", placement=SimpleNamespace(device="cuda"))
    nccl = SimpleNamespace(backend="nccl", device="cuda:0")
    assert mode_for(small, pool, "auto") == "whole" and mode_for(large, pool, "auto") == "ranks"
    sinks = small.replace(sinks=(0.5, -1.0, 0.0, 2.0))
    assert mode_for(sinks, pool, "auto") == "local"
    assert mode_for(small, gpu, "auto") == mode_for(small, nccl, "auto") == "ranks"
    assert mode_for(large, pool, "local") == "local" and mode_for(small, pool, "ranks") == "ranks"
    cache.clear()
    r = run_case(small, pool)
    assert r.verdict == Verdict.PASS and r.timings["oracle_share_s"] == 0


def test_the_one_pass_oracle_is_the_shares_oracle_in_float64_and_a_plain_base():
    """Issue #55: a small case's oracle in one pass (`assemble.whole`). Its exact outputs and term
    scales are the shares' to float64 rounding, on every training battery case without sinks. Its
    base is plain attention as one autograd graph rounds it
    (`test_the_base_errs_like_plain_attention_under_autograd`)."""
    cases = [
        c
        for c in default_battery(4)
        if assemble.whole_ok(c) and c.total_len <= 64 and c.softcap is None and not c.alibi
    ]
    assert len(cases) >= 20
    for c in cases:
        (exact, base), (wexact, wbase) = assemble.local(c), assemble.whole(c)
        for f in FIELDS:
            x, y = getattr(exact, f), getattr(wexact, f)
            fin = torch.isfinite(x)
            assert torch.equal(fin, torch.isfinite(y)), (c.summary(), f)
            torch.testing.assert_close(
                y[fin],
                x[fin],
                rtol=1e-11,
                atol=1e-12 * float(x[fin].abs().max() if fin.any() else 1),
            )
            assert getattr(wbase, f).dtype == getattr(base, f).dtype
        for t, classes in exact.term_scale.items():
            for k, v in classes.items():
                assert wexact.term_scale[t][k] == pytest.approx(v, rel=1e-12), (c.summary(), t, k)


@pytest.mark.parametrize("budget", [0, 1 << 14])
def test_kept_tiles_give_the_oracle_the_same_bits(monkeypatch, budget):
    """Issue #55: a rows pass keeps each tile's scores and base dP for its later sweeps, and one
    pass hands the gradient sweep's tiles to the keys pass (`TileStore`). Every output and term
    scale keeps its bits, one pass and share by share, on battery cases with every variant, GQA and
    the three dtypes. A store too small for some tiles forms those again."""
    from harness.oracle import tile_store

    training = [c for c in default_battery(4) if c.serving is None]
    cases = training[:60:4] + [c for c in training if c.softcap or c.alibi or c.sinks is not None]
    assert {c.dtype for c in cases} == {"fp32", "fp16", "bf16"}
    assert any(c.sinks is not None for c in cases) and any(c.alibi for c in cases)
    assert any(c.dim_v != c.head_dim for c in cases) and any(c.softcap for c in cases)
    taken = []
    real = tile_store.TileStore.take

    def take(self, kind, pos, again=False):
        got = real(self, kind, pos, again)
        taken.append((kind, got is not None))
        return got

    monkeypatch.setattr(tile_store.TileStore, "take", take)
    monkeypatch.setattr(assemble, "block", lambda case: 16)  # several tiles a case
    monkeypatch.setattr(tiles, "block", lambda case: 16)
    for c in cases:
        kept = (assemble.whole(c), assemble.local(c))
        with monkeypatch.context() as m:
            m.setattr(tile_store, "BUDGET_BYTES", budget)
            formed = (assemble.whole(c), assemble.local(c))
        for pair_kept, pair_formed in zip(kept, formed, strict=True):
            for a, b in zip(pair_kept, pair_formed, strict=True):
                _same_outputs(a, b, c.summary())
    for kind in ("base", "exact", "dp", "grad"):
        got = [hit for k, hit in taken if k == kind]
        assert any(got) and not all(got), kind
