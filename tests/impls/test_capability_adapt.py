"""`adapt`: a case reshaped to what an implementation declares. Zigzag local lengths made even, head
counts rounded up to multiples of the world size, document starts kept valid."""

from __future__ import annotations

import pytest

from harness.context import Capabilities
from ring_impl.masks import MaskSpec

# no odd zigzag local lengths (issue #10); ODD_HEADS also needs heads the world size divides (#11)
ODD_HEADS = Capabilities(zigzag_odd=False, heads_divisible_by_world=True)
ODD = Capabilities(zigzag_odd=False)


def _case(**kw):
    from harness.case import make_case

    base = dict(
        world_size=4,
        seq_lens=(3, 3, 3, 3),
        layout="zigzag",
        mask=MaskSpec("causal"),
        heads_q=4,
        heads_kv=2,
        head_dim=16,
        seed=7,
    )
    return make_case(**{**base, **kw})


@pytest.mark.parametrize(
    "caps, fields, lens",
    [
        (ODD, {}, (4, 4, 4, 4)),  # an even split: the total rounded up to a multiple of 2W
        (ODD, dict(world_size=1, seq_lens=(3,)), (4,)),  # W=1
        (ODD, dict(world_size=1, seq_lens=(1,)), (2,)),
        (
            ODD,
            dict(seq_lens=(5, 1, 17, 3)),
            (6, 2, 18, 4),
        ),  # uneven declared: each length rounded up
        (ODD, dict(world_size=3, seq_lens=(7, 6, 6)), (8, 6, 6)),  # an odd total
        (
            Capabilities(zigzag_odd=False, uneven=False),
            dict(world_size=3, seq_lens=(7, 6, 6)),
            (8, 8, 8),
        ),
        (Capabilities(zigzag_odd=False, uneven=False), dict(seq_lens=(7, 7, 7, 6)), (8, 8, 8, 8)),
        # a smaller world keeps the total (9 -> 5 + 4), then the odd length is rounded up
        (
            Capabilities(zigzag_odd=False, world_sizes=(1, 2)),
            dict(world_size=3, seq_lens=(3, 3, 3)),
            (6, 4),
        ),
        (
            Capabilities(zigzag_odd=False, world_sizes=(1, 2), uneven=False),
            dict(world_size=3, seq_lens=(3, 3, 3)),
            (6, 6),
        ),
        (
            Capabilities(zigzag_odd=False, layouts=frozenset({"zigzag"})),
            dict(layout="contiguous"),
            (4, 4, 4, 4),
        ),
        (ODD, dict(layout="contiguous"), (3, 3, 3, 3)),  # odd lengths are fine outside zigzag
    ],
)
def test_adapt_makes_zigzag_local_lengths_even(caps, fields, lens):
    from harness.impls.capabilities import adapt, unsupported

    c = _case(**fields)
    a = adapt(caps, c)
    assert a is not None and not unsupported(caps, a)
    assert tuple(a.seq_lens) == lens
    assert (a.heads_q, a.heads_kv, a.head_dim, a.seed, a.mask) == (
        c.heads_q,
        c.heads_kv,
        c.head_dim,
        c.seed,
        c.mask,
    )
    if a.layout == "zigzag" and len(set(lens)) == 1:
        assert a.total_len % (2 * a.world_size) == 0


def test_adapt_keeps_document_starts_valid():
    from harness.impls.capabilities import adapt, unsupported

    doc = MaskSpec("document", doc_starts=(0, 2, 5, 11), causal=True)
    c = _case(mask=doc)
    a = adapt(ODD, c)
    assert a.seq_lens == (4, 4, 4, 4) and a.mask == doc and not unsupported(ODD, a)
    # a smaller world keeps the total; the starts that are left are all inside the sequence
    caps = Capabilities(zigzag_odd=False, world_sizes=(1, 2), uneven=False)
    a = adapt(
        caps,
        _case(world_size=3, seq_lens=(3, 3, 3), mask=MaskSpec("document", doc_starts=(0, 4, 8))),
    )
    assert a.seq_lens == (6, 6) and a.mask.doc_starts == (0, 4, 8) and not unsupported(caps, a)


@pytest.mark.parametrize(
    "caps, fields, heads",
    [
        # MQA -> GQA, still grouped
        (ODD_HEADS, dict(world_size=3, seq_lens=(4, 4, 4), heads_q=4, heads_kv=1), (6, 3)),
        (ODD_HEADS, dict(world_size=3, seq_lens=(4, 4, 4), heads_q=4, heads_kv=2), (6, 3)),
        # at least 2 query heads per kv head
        (ODD_HEADS, dict(seq_lens=(4,) * 4, heads_q=2, heads_kv=1), (8, 4)),
        (ODD_HEADS, dict(seq_lens=(4,) * 4, heads_q=6, heads_kv=3), (8, 4)),
        (ODD_HEADS, dict(seq_lens=(4,) * 4, heads_q=2, heads_kv=2), (4, 4)),  # MHA stays MHA
        (ODD_HEADS, dict(seq_lens=(4,) * 8, world_size=8, heads_q=6, heads_kv=1), (16, 8)),
        (
            Capabilities(heads_divisible_by_world=True, gqa=False),
            dict(world_size=3, seq_lens=(4, 4, 4)),
            (6, 6),
        ),
        (
            Capabilities(heads_divisible_by_world=True, world_sizes=(1, 2)),
            dict(world_size=3, seq_lens=(4, 4, 4), heads_q=3, heads_kv=1),
            (4, 2),
        ),
        (
            ODD_HEADS,
            dict(world_size=1, seq_lens=(4,), heads_q=5, heads_kv=1),
            (5, 1),
        ),  # W=1: unchanged
    ],
)
def test_adapt_rounds_head_counts_up_to_multiples_of_w(caps, fields, heads):
    from harness.impls.capabilities import adapt, unsupported

    c = _case(**fields)
    a = adapt(caps, c)
    assert a is not None and not unsupported(caps, a)
    assert (a.heads_q, a.heads_kv) == heads
    assert a.heads_q % a.world_size == 0 or a.world_size == 1
    assert a.heads_q % a.heads_kv == 0 and (a.heads_q > a.heads_kv) == (heads[0] > heads[1])


def test_adapt_of_any_drawn_case_is_supported():
    """Every case the unrestricted strategy draws adapts to one the narrow capabilities declare."""
    from hypothesis import HealthCheck, given, settings

    from harness.impls.capabilities import adapt, unsupported
    from harness.search import strategies

    caps_list = [
        ODD_HEADS,
        Capabilities(zigzag_odd=False, uneven=False, heads_divisible_by_world=True, gqa=False),
        Capabilities(
            zigzag_odd=False, layouts=frozenset({"zigzag"}), world_sizes=(2, 4), uneven=False
        ),
    ]

    @settings(
        max_examples=150, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategies.cases())
    def check(c):
        for caps in caps_list:
            a = adapt(caps, c)
            assert a is not None and not unsupported(caps, a), (caps, c.summary())
            if a.mask.kind == "document":
                assert a.mask.doc_starts[0] == 0 and max(a.mask.doc_starts) < a.total_len

    check()
