"""Inference shapes as position maps (ring_impl.serving, issue #54): requests, KV shares, queries."""

from __future__ import annotations

import pytest
import torch

from ring_impl.serving import (
    KV_LAYOUTS,
    Requests,
    check_positions,
    kv_positions,
    local_lengths,
    query_positions,
    slot_position,
)


@pytest.mark.parametrize("kv", KV_LAYOUTS)
@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_the_kv_shares_partition_every_request(kv, w):
    req = Requests((700, 33, 0, 5), (1, 1, 4, 2), kv=kv, interleave=16)
    shares = kv_positions(req, w)
    check_positions(shares, req.total)
    for p in shares:  # request by request, each in increasing position
        assert torch.equal(p, p.sort().values)
    assert [sum(n) for n in local_lengths(req, w)] == [p.numel() for p in shares]


@pytest.mark.parametrize("interleave", [1, 2, 16])
def test_interleaved_slots_follow_vllms_slot_mapping(interleave):
    """Local slot c on rank r holds token floor(c/I) W I + r I + c mod I of the request."""
    w, n = 4, 203
    req = Requests((n - 1,), (1,), kv="interleaved", interleave=interleave)
    for r, p in enumerate(kv_positions(req, w)):
        assert p.tolist() == [slot_position(c, r, w, interleave) for c in range(p.numel())]


def test_queries_are_the_new_tokens_own_or_replicated():
    req = Requests((5, 0, 3), (1, 3, 2), kv="contiguous")
    every = req.query_positions().tolist()
    assert every == [5, 6, 7, 8, 12, 13] and req.starts == (0, 6, 9)
    own = query_positions(req, 2)
    assert sorted(torch.cat(own).tolist()) == every
    for q, k in zip(own, kv_positions(req, 2), strict=True):
        assert torch.isin(q, k).all()  # a rank's queries are tokens whose KV it holds
    rep = query_positions(Requests((5,), (2,), queries="replicated"), 3)
    assert all(q.tolist() == [5, 6] for q in rep)


def test_a_request_needs_a_new_token():
    with pytest.raises(ValueError, match="at least one new token"):
        Requests((4,), (0,))
