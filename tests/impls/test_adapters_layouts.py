"""Each adapter's mapping from our layouts to the library's own sharding, checked
device-independently.

The third-party sharding conventions are re-stated from the libraries' tests/helpers
(ring-flash-attn's `extract_local`, yunchang's `EXTRACT_FUNC_DICT`, TE's dual-chunk `index_select`)
or, for torch, taken from torch's own head-tail load balancer.
"""

from __future__ import annotations

import pytest
import torch

from harness.impls.adapters import ring_flash_attn, te_cp, torch_ring, yunchang
from ring_impl.layouts import all_positions

EVEN = [(8, 2), (12, 3), (16, 4), (24, 4), (16, 8)]  # (total, W) with total divisible by 2W


def _ours(layout: str, total: int, w: int) -> list[torch.Tensor]:
    return all_positions(layout, [total // w] * w)


@pytest.mark.parametrize("total,w", EVEN)
def test_torch_head_tail_balancer_is_our_zigzag(total, w):
    theirs = torch_ring.head_tail_positions(total, w)
    for r, (a, b) in enumerate(zip(theirs, _ours("zigzag", total, w), strict=True)):
        assert torch.equal(a, b), f"rank {r}: torch {a.tolist()} vs zigzag {b.tolist()}"


@pytest.mark.parametrize("total,w", EVEN)
def test_torch_head_tail_is_not_contiguous(total, w):
    theirs = torch_ring.head_tail_positions(total, w)
    assert any(
        not torch.equal(a, b) for a, b in zip(theirs, _ours("contiguous", total, w), strict=True)
    )


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("total,w", EVEN)
def test_ring_flash_attn_extract_local_matches(layout, total, w):
    x = torch.arange(total).view(1, total)
    for r, ours in enumerate(_ours(layout, total, w)):
        assert torch.equal(ring_flash_attn.extract_local(layout, x, r, w).view(-1), ours), (
            layout,
            r,
        )


def test_ring_flash_attn_variant_layouts():
    layouts = {name: v.capabilities.layouts for name, v in ring_flash_attn.VARIANTS.items()}
    assert layouts == {
        "ring-flash-attn": {"contiguous"},
        "ring-flash-attn-zigzag": {"zigzag"},
        "ring-flash-attn-stripe": {"striped"},
        "ring-flash-attn-llama3": {"contiguous"},
    }


@pytest.mark.parametrize("total,w", EVEN)
def test_te_dual_chunk_is_our_zigzag(total, w):
    for r, ours in enumerate(_ours("zigzag", total, w)):
        assert torch.equal(te_cp.dual_chunk_positions(total, w, r), ours)


@pytest.mark.parametrize("total,w", EVEN)
def test_yunchang_pure_ring_shardings(total, w):
    x = torch.arange(total).view(1, total)
    for kind, layout in (("basic", "contiguous"), ("zigzag", "zigzag"), ("strip", "striped")):
        assert yunchang.RING_TYPE[layout] == kind
        for r, ours in enumerate(_ours(layout, total, w)):
            got = yunchang.extract_local(kind, x, r, w, ring=w, ulysses=1).view(-1)
            assert torch.equal(got, ours), (kind, r)


def test_yunchang_usp_groups_and_basic_sharding_are_contiguous():
    uly, ring = yunchang.usp_groups((4, 5, 6, 7, 8, 9), ulysses=3)
    assert uly == [[4, 5, 6], [7, 8, 9]]
    assert ring == [[4, 7], [5, 8], [6, 9]]
    x = torch.arange(24).view(1, 24)
    for r, ours in enumerate(_ours("contiguous", 24, 6)):
        assert torch.equal(
            yunchang.extract_local("basic", x, r, 6, ring=2, ulysses=3).view(-1), ours
        )


def test_yunchang_usp_zigzag_is_none_of_our_layouts():
    """Why yunchang-usp declares only the contiguous layout: zigzag over a ring of 2 split over 2
    Ulysses ranks gives each rank one chunk in the order 0, 3, 1, 2."""
    x = torch.arange(16).view(1, 16)
    got = [yunchang.extract_local("zigzag", x, r, 4, ring=2, ulysses=2).view(-1) for r in range(4)]
    assert [int(g[0]) // 4 for g in got] == [0, 3, 1, 2]
    for layout in ("contiguous", "zigzag", "striped"):
        assert not all(torch.equal(a, b) for a, b in zip(got, _ours(layout, 16, 4), strict=True))


@pytest.mark.parametrize(
    "w,hq,hkv,expected", [(4, 8, 8, (2, 2)), (6, 6, 3, (3, 2)), (8, 8, 4, (4, 2))]
)
def test_yunchang_usp_degrees(w, hq, hkv, expected):
    assert yunchang.usp_degrees(w, hq, hkv) == expected


def test_yunchang_usp_degrees_refuses():
    from harness.errors import ImplError

    with pytest.raises(ImplError, match="no Ulysses degree"):
        yunchang.usp_degrees(4, 3, 3)
