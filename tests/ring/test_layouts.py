"""Layouts as position maps: round trips, the zigzag and striped placements, uneven and empty
shards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ring_impl import layouts

LENGTHS = [
    [6],
    [3, 3],
    [4, 4, 4],
    [5, 1, 17, 3],
    [0, 3, 0, 2],
    [0, 0, 0],
    [2, 0, 5, 1, 3, 4, 0, 2],
    [1, 2],
]


def test_split_lengths():
    assert layouts.split_lengths(10, 4) == [3, 3, 2, 2]
    assert layouts.split_lengths(3, 5) == [1, 1, 1, 0, 0]
    assert layouts.split_lengths(0, 2) == [0, 0]
    with pytest.raises(ValueError):
        layouts.split_lengths(4, 0)
    with pytest.raises(ValueError):
        layouts.split_lengths(-1, 2)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_positions_partition_the_sequence(layout, lengths):
    pos = layouts.all_positions(layout, lengths)
    assert [p.numel() for p in pos] == lengths
    assert all(p.dtype == torch.long for p in pos)
    assert sorted(torch.cat(pos).tolist()) == list(range(sum(lengths)))


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_shard_unshard_round_trip(layout, lengths):
    total = sum(lengths)
    x = torch.arange(2 * total * 3, dtype=torch.float32).view(2, total, 3)
    shards = [layouts.shard(x, layout, lengths, r) for r in range(len(lengths))]
    assert [s.shape[1] for s in shards] == lengths
    assert all(s.is_contiguous() for s in shards)
    for r, s in enumerate(shards):  # each shard holds exactly its positions, in local order
        assert torch.equal(s, x[:, layouts.positions(layout, lengths, r)])
    assert torch.equal(layouts.unshard(shards, layout, lengths), x)
    lse_like = x.transpose(1, 2).contiguous()  # sequence on dim 2, like lse (B, H, L)
    lse_shards = [layouts.shard(lse_like, layout, lengths, r, dim=2) for r in range(len(lengths))]
    assert torch.equal(layouts.unshard(lse_shards, layout, lengths, dim=2), lse_like)


def test_contiguous_is_consecutive_ranges():
    pos = layouts.all_positions("contiguous", [5, 1, 17, 3])
    assert pos[0].tolist() == [0, 1, 2, 3, 4]
    assert pos[1].tolist() == [5]
    assert pos[2].tolist() == list(range(6, 23))
    assert pos[3].tolist() == [23, 24, 25]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_zigzag_rank_r_holds_chunks_r_and_2w_minus_1_minus_r(world_size):
    chunk = 3
    total = 2 * world_size * chunk
    lengths = layouts.split_lengths(total, world_size)
    for r in range(world_size):
        first = list(range(r * chunk, (r + 1) * chunk))
        second = list(range((2 * world_size - 1 - r) * chunk, (2 * world_size - r) * chunk))
        assert layouts.positions("zigzag", lengths, r).tolist() == first + second


def test_zigzag_uneven_chunks():
    # rank r splits its length into ceil/floor halves; chunks in sequence order 0a 1a 2a 2b 1b 0b
    pos = layouts.all_positions("zigzag", [5, 1, 4])
    assert pos[0].tolist() == [0, 1, 2, 8, 9]
    assert pos[1].tolist() == [3]
    assert pos[2].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("total", [16, 21])
def test_striped_token_i_on_rank_i_mod_w(world_size, total):
    lengths = layouts.split_lengths(total, world_size)
    pos = layouts.all_positions("striped", lengths)
    for r in range(world_size):
        assert pos[r].tolist() == list(range(r, total, world_size))


def test_errors():
    x = torch.zeros(1, 5, 2)
    with pytest.raises(ValueError):
        layouts.shard(x, "contiguous", [2, 2], 0)  # lengths cover 4 tokens, x has 5
    with pytest.raises(ValueError):
        layouts.all_positions("diagonal", [2, 2])
    with pytest.raises(ValueError):
        layouts.all_positions("zigzag", [2, -1])
    with pytest.raises(ValueError):
        layouts.positions("striped", [2, 2], 2)
    with pytest.raises(ValueError):
        layouts.unshard([torch.zeros(1, 2, 2), torch.zeros(1, 3, 2)], "contiguous", [2, 2])


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    layout=st.sampled_from(layouts.LAYOUTS),
    lengths=st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=8),
)
def test_round_trip_any_lengths(layout, lengths):
    total = sum(lengths)
    x = torch.randn(1, total, 2)
    shards = [layouts.shard(x, layout, lengths, r) for r in range(len(lengths))]
    assert torch.equal(layouts.unshard(shards, layout, lengths), x)
