"""Masks decided by global positions, checked against brute-force definitions."""

from __future__ import annotations

import pytest
import torch

from ring_impl.mask_eval import allowed, block_is_empty, doc_ids, full_mask, visible_keys
from ring_impl.masks import MaskSpec
from tests.helpers.masks import brute

STARTS = (0, 4, 9, 15)


SPECS = [
    MaskSpec(),
    MaskSpec("causal"),
    MaskSpec("window", window=0),
    MaskSpec("window", window=3),
    MaskSpec("document", doc_starts=STARTS),
    MaskSpec("document", doc_starts=STARTS, causal=False),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: str(s.to_dict()))
def test_allowed_matches_brute_force(spec):
    g = torch.Generator().manual_seed(0)
    q_pos, k_pos = torch.randperm(20, generator=g)[:9], torch.randperm(20, generator=g)[:13]
    m = allowed(spec, q_pos, k_pos)
    want = torch.tensor([[brute(spec, int(i), int(j)) for j in k_pos] for i in q_pos])
    if spec.kind == "none":
        assert m is None
    else:
        assert m.dtype == torch.bool and m.shape == (9, 13)
        assert torch.equal(m, want)
    full = full_mask(spec, 20)
    want_full = torch.tensor([[brute(spec, i, j) for j in range(20)] for i in range(20)])
    assert (full is None) if spec.kind == "none" else torch.equal(full, want_full)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: str(s.to_dict()))
def test_block_is_empty_agrees_with_allowed(spec):
    g = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(60):
        n_q, n_k = torch.randint(0, 5, (2,), generator=g).tolist()
        q_pos, k_pos = torch.randperm(24, generator=g)[:n_q], torch.randperm(24, generator=g)[:n_k]
        m = allowed(spec, q_pos, k_pos)
        want = n_q == 0 or n_k == 0 or (m is not None and not bool(m.any()))
        assert block_is_empty(spec, q_pos, k_pos) == want
        seen.add(want)
    if spec.kind != "none":
        assert seen == {True, False}  # the sample exercised both answers


def test_doc_ids_and_visible_keys():
    spec = MaskSpec("document", doc_starts=STARTS)
    assert doc_ids(spec, torch.tensor([0, 3, 4, 8, 9, 14, 15, 30])).tolist() == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert visible_keys(spec, [5], 20).nonzero().view(-1).tolist() == [4, 5]
    assert visible_keys(MaskSpec("causal"), [2, 6], 10).nonzero().view(-1).tolist() == list(
        range(7)
    )
    assert visible_keys(MaskSpec("window", window=1), [3, 9], 10).nonzero().view(-1).tolist() == [
        2,
        3,
        8,
        9,
    ]
    assert visible_keys(MaskSpec(), [], 4).all()


def test_spec_validation_and_dict():
    for bad in (
        dict(kind="diagonal"),
        dict(kind="window"),
        dict(kind="window", window=-1),
        dict(kind="document"),
        dict(kind="document", doc_starts=(1, 4)),
        dict(kind="document", doc_starts=(0, 4, 4)),
    ):
        with pytest.raises(ValueError):
            MaskSpec(**bad)
    assert MaskSpec("document", doc_starts=[0, 3]).doc_starts == (0, 3)
    assert MaskSpec("window", window=2).to_dict() == {"kind": "window", "window": 2}
    assert MaskSpec("document", doc_starts=(0, 3), causal=False).to_dict() == {
        "kind": "document",
        "doc_starts": [0, 3],
        "causal": False,
    }
    assert [s.is_causal for s in SPECS] == [False, True, True, True, True, False]


def test_a_remembered_mask_is_a_copy_and_is_keyed_by_the_spec_and_positions():
    from ring_impl import mask_eval

    spec = MaskSpec("document", doc_starts=STARTS)
    q_pos, k_pos = torch.arange(3, 11), torch.arange(0, 20)
    first = allowed(spec, q_pos, k_pos)
    first.fill_(True)  # a caller that writes into its mask
    again = allowed(spec, q_pos, k_pos)
    want = torch.tensor([[brute(spec, int(i), int(j)) for j in k_pos] for i in q_pos])
    assert torch.equal(again, want)
    other = MaskSpec("document", doc_starts=(0, 10))  # another spec, the same positions
    want = torch.tensor([[brute(other, int(i), int(j)) for j in k_pos] for i in q_pos])
    assert torch.equal(allowed(other, q_pos, k_pos), want)
    # a block above MEMO_ENTRIES is computed each time, never kept
    big = torch.arange(200)
    n = len(mask_eval._MEMO)
    allowed(spec, big, big)
    assert len(mask_eval._MEMO) == n
