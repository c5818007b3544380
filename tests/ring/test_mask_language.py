"""The mask language (ring_impl.masks): every primitive and combinator against a brute-force n x
n predicate on random positions, the per-block decision, the data form, the original kinds as
sugar."""

from __future__ import annotations

import pytest
import torch

from harness.case import from_dict, make_case, to_dict
from harness.errors import HarnessError
from ring_impl.mask_eval import (
    FULL,
    PARTIAL,
    SKIP,
    allowed,
    block_decision,
    empty_rows,
    visible_keys,
)
from ring_impl.mask_parse import expr_from_dict
from ring_impl.masks import (
    PRIMITIVES,
    Expr,
    MaskSpec,
    and_,
    expr_to_dict,
    fit,
    not_,
    or_,
    prim,
)
from tests.helpers.masks import brute

N = 40
PRIMS = {
    "full": [prim("full")],
    "causal": [prim("causal")],
    "inverse-causal": [prim("inverse-causal")],
    "window": [
        prim("window", 0, 0),
        prim("window", 3, 0),
        prim("window", 2, 5),
        prim("window", 0, 4),
    ],
    "chunked": [prim("chunked", 1), prim("chunked", 7), prim("chunked", 16)],
    "dilated": [
        prim("dilated", 8, 2, 0),
        prim("dilated", 8, 2, 1),
        prim("dilated", 6, 4, 3),
        prim("dilated", 5, 1, 0),
    ],
    "prefix": [prim("prefix", 0), prim("prefix", 5), prim("prefix", 100)],
    "document": [prim("document", (0,)), prim("document", (0, 4, 9, 23))],
    "blocks": [prim("blocks", 8, ((0, 0), (1, 0), (1, 1), (3, 2), (4, 4))), prim("blocks", 3, ())],
}
COMBOS = [
    and_(prim("causal"), prim("chunked", 8)),  # Llama 4 chunked local attention
    or_(prim("causal"), prim("prefix", 6)),  # prefix-LM
    or_(prim("causal"), prim("chunked", 5)),  # block-causal
    and_(prim("causal"), prim("inverse-causal")),  # bi-causal (the diagonal)
    not_(prim("causal")),
    and_(
        prim("document", (0, 7, 19)),
        or_(prim("window", 2, 0), prim("prefix", 3)),
        not_(prim("dilated", 4, 2, 1)),
    ),
    # global tokens + sliding window
    or_(prim("window", 4, 0), and_(prim("prefix", 3), prim("causal"))),
    # varlen block-causal
    Expr("per-document", ((0, 7, 19),), (or_(prim("causal"), prim("chunked", 4)),)),
    # prefix-LM per sample
    Expr("per-document", ((0, 9),), (or_(prim("causal"), prim("prefix", 3)),)),
    and_(
        Expr("per-document", ((0, 13, 14),), (prim("dilated", 4, 2, 1),)),
        not_(prim("window", 0, 0)),
    ),
]
EXPRS = [e for es in PRIMS.values() for e in es] + COMBOS


def _positions(seed: int, n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(N, generator=g)[:n_q], torch.randperm(N, generator=g)[:n_k]


def test_every_primitive_is_tested():
    assert set(PRIMS) == set(PRIMITIVES)


@pytest.mark.parametrize("e", EXPRS, ids=str)
def test_expression_matches_brute_force(e):
    spec = MaskSpec.of(e)
    for seed in range(3):
        q_pos, k_pos = _positions(seed, 11, 17)
        want = torch.tensor([[brute(spec, int(i), int(j)) for j in k_pos] for i in q_pos])
        m = allowed(spec, q_pos, k_pos)
        got = torch.ones_like(want) if m is None else m
        assert got.shape == want.shape and torch.equal(got, want)
    # the whole sequence, n x n, against the predicate (and the expression form evaluates alike)
    pos = torch.arange(N)
    whole = torch.tensor([[brute(spec, i, j) for j in range(N)] for i in range(N)])
    m = allowed(MaskSpec("expr", expr=e), pos, pos)
    assert torch.equal(m, whole)
    assert torch.equal(empty_rows(spec, N), ~whole.any(dim=1))
    assert torch.equal(visible_keys(spec, [3, 17, 30], N), whole[[3, 17, 30]].any(dim=0))


@pytest.mark.parametrize("e", EXPRS, ids=str)
def test_block_decision_agrees_with_the_mask(e):
    spec = MaskSpec.of(e)
    for seed in range(40):
        n_q, n_k = torch.randint(0, 9, (2,), generator=torch.Generator().manual_seed(seed)).tolist()
        q_pos, k_pos = _positions(100 + seed, n_q, n_k)
        m = allowed(spec, q_pos, k_pos)
        m = torch.ones(n_q, n_k, dtype=torch.bool) if m is None else m
        want = SKIP if m.numel() == 0 or not m.any() else FULL if m.all() else PARTIAL
        assert block_decision(spec, q_pos, k_pos) == want
        assert block_decision(spec, q_pos, k_pos, chunk=3) == want  # evaluated a few rows at a time


def test_contiguous_block_decisions():
    # contiguous blocks of 8 tokens: causal-and-chunked(8) is FULL on the diagonal block's lower
    # part, etc.
    spec = MaskSpec.of(and_(prim("causal"), prim("chunked", 8)))
    blk = [torch.arange(i, i + 8) for i in range(0, 32, 8)]
    assert block_decision(spec, blk[1], blk[0]) == SKIP  # another chunk: nothing
    assert block_decision(spec, blk[1], blk[1]) == PARTIAL  # its own chunk: the causal triangle
    assert (
        block_decision(MaskSpec.of(or_(prim("causal"), prim("chunked", 8))), blk[1], blk[1]) == FULL
    )
    assert block_decision(MaskSpec("causal"), blk[2], blk[0]) == FULL


@pytest.mark.parametrize(
    "spec",
    [
        MaskSpec(),
        MaskSpec("causal"),
        MaskSpec("window", window=3),
        MaskSpec("document", doc_starts=(0, 5, 11)),
        MaskSpec("document", doc_starts=(0, 5, 11), causal=False),
    ],
    ids=str,
)
def test_original_kinds_are_sugar_for_expressions(spec):
    e = spec.expression()
    assert MaskSpec.of(e) == spec
    pos = torch.arange(N)
    m = allowed(spec, pos, pos)
    m = torch.ones(N, N, dtype=torch.bool) if m is None else m
    assert torch.equal(allowed(MaskSpec("expr", expr=e), pos, pos), m)
    assert spec.is_causal == MaskSpec("expr", expr=e).is_causal


def test_data_form_round_trips_and_old_files_keep_their_form():
    for e in EXPRS:
        assert expr_from_dict(expr_to_dict(e)) == e
        c = make_case(world_size=2, total_len=N, mask=expr_to_dict(e))
        assert from_dict(to_dict(c)) == c
    assert to_dict(make_case(world_size=2, total_len=8, mask={"kind": "causal"}))["mask"] == {
        "kind": "causal"
    }
    old = {"kind": "document", "doc_starts": [0, 3], "causal": False}
    assert to_dict(make_case(world_size=2, total_len=8, mask=old))["mask"] == old
    # an expression written as an original kind is that kind
    c = make_case(
        world_size=2,
        total_len=8,
        mask={"and": [{"kind": "document", "starts": [0, 3]}, {"kind": "causal"}]},
    )
    assert c.mask == MaskSpec("document", doc_starts=(0, 3))
    assert make_case(
        world_size=2, total_len=8, mask={"kind": "window", "left": 2, "right": 0}
    ).mask == MaskSpec("window", window=2)


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"kind": "chunked"}, "chunked needs size"),
        ({"kind": "chunked", "size": 0}, "size must be an integer in [1, 2**40]"),
        ({"kind": "dilated", "segment": 4, "rate": 2, "offset": 2}, "offset must be < rate"),
        ({"and": []}, "and: must be a non-empty list"),
        ({"or": [{"kind": "causal"}, {"kind": "wobble"}]}, "or[1]: unknown kind 'wobble'"),
        (
            {"not": {"kind": "prefix", "length": -1}},
            "not: prefix: length must be an integer in [0, 2**40]",
        ),
        ({"and": [{"kind": "causal"}], "or": []}, "exactly one key"),
        ({"kind": "window", "left": 1}, "window needs right"),
        (
            {"kind": "blocks", "size": 2, "pairs": [[0]]},
            "pairs must be a list of [query block, key block] pairs",
        ),
        ({"kind": "causal", "size": 3}, "unknown key(s) size for causal"),
        (
            {"per-document": {"starts": [2, 5], "mask": {"kind": "causal"}}},
            "per-document: document: starts must begin",
        ),
        (
            {"per-document": {"mask": {"kind": "causal"}}},
            "per-document: must be a mapping with starts and mask",
        ),
        (
            {"per-document": {"starts": [0], "mask": {"kind": "chunked"}}},
            "per-document.mask: chunked needs size",
        ),
        (
            {"or": [{"kind": "causal"}, {"kind": "document", "starts": [0, 99]}]},
            "document start 99 is beyond",
        ),
    ],
)
def test_bad_masks_get_one_line_naming_the_field(bad, words):
    with pytest.raises(HarnessError) as e:
        make_case(world_size=2, total_len=10, mask=bad)
    msg = str(e.value)
    assert msg.startswith("case field 'mask': ") and words in msg and "\n" not in msg


def test_summary_needs_and_causality():
    c = make_case(world_size=2, total_len=16, mask=expr_to_dict(COMBOS[0]))
    assert " causal&chunked(8) " in c.summary()
    assert c.mask.needs() == {"expr", "and", "causal", "chunked"}
    assert MaskSpec.of(COMBOS[1]).is_causal is False and MaskSpec.of(COMBOS[0]).is_causal is True
    assert str(COMBOS[5]) == "doc(3)&(window(2,0)|prefix(3))&!dilated(4,2,1)"


def test_fit_drops_document_starts_beyond_the_sequence():
    spec = MaskSpec.of(and_(prim("document", (0, 4, 9)), prim("causal"), prim("prefix", 2)))
    cut = fit(spec, 6)
    assert isinstance(cut.expr, Expr) and cut.expr.args[0].param("starts") == (0, 4)
    assert fit(MaskSpec("document", doc_starts=(0, 4, 9)), 5) == MaskSpec(
        "document", doc_starts=(0, 4)
    )


@pytest.mark.parametrize(
    "e",
    [
        prim("dilated", 6, 3, 2),
        not_(prim("causal")),
        and_(prim("prefix", 5), prim("inverse-causal")),
        COMBOS[5],
    ],
    ids=str,
)
@pytest.mark.parametrize("tiles", [None, "64"], ids=["one-tile", "tiled"])
def test_single_rank_ring_rows_that_see_nothing(e, tiles, monkeypatch):
    """The reference ring (one rank, tiled and untiled) on a mask with empty rows: out = 0, lse =
    -inf, dq = 0 there, dk = dv = 0 for keys no query sees, no NaN, and the rest equal to float64
    attention."""
    from ring_impl import ring_attention
    from ring_impl.kernel import TILE_ENV

    if tiles:
        monkeypatch.setenv(TILE_ENV, tiles)  # 2 heads x 16 x 16 > 64: tiles of 16 tokens
    spec, n = MaskSpec.of(e), 23
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    m = allowed(spec, torch.arange(n), torch.arange(n))
    empty, unseen = ~m.any(dim=1), ~m.any(dim=0)
    assert empty.any() and not empty.all()
    # float64 reference with the explicit mask; rows that see nothing are 0 by definition
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 8**-0.5
    p = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1).nan_to_num(0.0)
    want = torch.einsum("bhqk,bkhd->bqhd", p, v)
    qs, ks, vs = (t.float().requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(qs, ks, vs, mask=spec, return_lse=True)
    out.backward(dout.float())
    for t in (out, qs.grad, ks.grad, vs.grad):
        assert not t.isnan().any()
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert bool((out[:, empty] == 0).all()) and bool((qs.grad[:, empty] == 0).all())
    assert bool((lse[:, :, empty] == float("-inf")).all()) and bool(
        torch.isfinite(lse[:, :, ~empty]).all()
    )
    assert bool((ks.grad[:, unseen] == 0).all()) and bool((vs.grad[:, unseen] == 0).all())
