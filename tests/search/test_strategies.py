"""Hypothesis strategies: only what an implementation declares, every feature reachable, budget
respected, and shrinking towards the smallest world, shortest sequence, fewest heads, simplest
mask."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from harness.context import Capabilities
from harness.diagnose.localise import owners
from harness.search import strategies

FAST = settings(
    max_examples=120, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)
# find() is random otherwise: a local minimum may differ
SHRINK = settings(database=None, derandomize=True)
SEARCH = settings(
    max_examples=2000,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)

NARROW = Capabilities(
    layouts=frozenset({"zigzag"}),
    masks=frozenset({"causal", "document"}),
    dtypes=frozenset({"bf16"}),
    gqa=False,
    uneven=False,
    world_sizes=(2, 4),
    head_dims=(8, 16),
    subgroups=False,
)


@FAST
@given(strategies.cases(NARROW, impl="mine", pool_size=6))
def test_draws_only_what_the_capabilities_declare(c):
    assert c.layout == "zigzag"
    assert c.mask.kind in ("causal", "document")
    assert c.dtype == "bf16"
    assert c.heads_q == c.heads_kv
    assert len(set(c.seq_lens)) == 1
    assert 2 <= c.world_size <= 4
    assert c.head_dim in (8, 16)
    assert c.impl == "mine"
    assert c.group_offset == 0  # no subgroups: the ring is global ranks 0..W-1


EVEN_ZIGZAG = Capabilities(zigzag_odd=False, heads_divisible_by_world=True)
EVEN_ZIGZAG_NARROW = Capabilities(
    layouts=frozenset({"zigzag"}),
    uneven=False,
    gqa=False,
    zigzag_odd=False,
    heads_divisible_by_world=True,
)


@FAST
@given(strategies.cases(EVEN_ZIGZAG), strategies.cases(EVEN_ZIGZAG_NARROW, subgroups=False))
def test_never_draws_odd_zigzag_lengths_or_indivisible_heads_where_undeclared(c, narrow):
    from harness.impls.capabilities import unsupported

    for caps, case in ((EVEN_ZIGZAG, c), (EVEN_ZIGZAG_NARROW, narrow)):
        assert unsupported(caps, case) == []
        if case.layout == "zigzag":
            assert all(n % 2 == 0 for n in case.seq_lens)
        assert case.heads_q % case.world_size == 0 and case.heads_kv % case.world_size == 0
        assert case.heads_q % case.heads_kv == 0
        # odd lengths made even: one less, a 1-token shard one more
        assert case.total_len <= 64 + case.world_size
        if case.mask.kind == "document":
            assert case.mask.doc_starts[0] == 0 and case.mask.doc_starts[-1] < case.total_len
    assert len(set(narrow.seq_lens)) == 1 and narrow.heads_q == narrow.heads_kv


@pytest.mark.parametrize(
    "what", ["odd local lengths elsewhere", "uneven even zigzag", "GQA at W=4", "W=1 MQA"]
)
def test_the_rest_is_still_drawn_with_even_zigzag_and_divisible_heads(what):
    cond = {
        "odd local lengths elsewhere": lambda c: (
            c.layout != "zigzag" and any(n % 2 for n in c.seq_lens)
        ),
        "uneven even zigzag": lambda c: (
            c.layout == "zigzag" and len(set(c.seq_lens)) > 1 and c.world_size >= 3
        ),
        "GQA at W=4": lambda c: c.world_size == 4 and c.heads_q > c.heads_kv,
        "W=1 MQA": lambda c: c.world_size == 1 and c.heads_kv == 1 and c.heads_q > 1,
    }[what]
    find(strategies.cases(EVEN_ZIGZAG), cond, settings=SEARCH)


def test_an_even_zigzag_failure_shrinks_to_two_tokens_per_rank():
    c = find(
        strategies.cases(EVEN_ZIGZAG),
        lambda c: c.layout == "zigzag" and c.world_size >= 2,
        settings=SHRINK,
    )
    assert (c.world_size, c.seq_lens, c.heads_q, c.heads_kv) == (2, (2, 2), 2, 2)


@FAST
@given(strategies.cases())
def test_cases_fit_the_budget(c):
    assert c.total_len <= 64
    assert c.head_dim <= 32 and c.batch <= 2 and c.heads_q <= 6
    assert 1 <= c.world_size <= 8 and c.pool_size <= 8
    assert min(c.seq_lens) >= 1
    assert c.heads_q % c.heads_kv == 0
    if c.mask.kind == "document":
        assert c.mask.doc_starts[0] == 0 and c.mask.doc_starts[-1] < c.total_len


def _straddles(c) -> bool:
    """A document that holds tokens of two or more ranks (and is not the whole sequence)."""
    if c.mask.kind != "document" or len(c.mask.doc_starts) < 2:
        return False
    own = owners(c).tolist()
    bounds = [*c.mask.doc_starts, c.total_len]
    return any(len(set(own[a:b])) > 1 for a, b in zip(bounds, bounds[1:], strict=False))


FEATURES = {
    "W=1": lambda c: c.world_size == 1,
    "W=8": lambda c: c.world_size == 8,
    "ring in a subgroup": lambda c: c.group_offset > 0,
    "GQA": lambda c: c.heads_q > c.heads_kv > 1,
    "MQA": lambda c: c.heads_kv == 1 and c.heads_q > 1,
    "uneven split": lambda c: len(set(c.seq_lens)) > 1,
    "length-1 shard beside a longer one": lambda c: min(c.seq_lens) == 1 and max(c.seq_lens) > 1,
    "very short sequence": lambda c: c.total_len <= 2,
    "largest that fits": lambda c: c.total_len == 64,
    "small window": lambda c: c.mask.kind == "window" and c.mask.window <= 1,
    "document straddling ranks": _straddles,
    "non-causal documents": lambda c: (
        c.mask.kind == "document" and not c.mask.causal and len(c.mask.doc_starts) > 2
    ),
    "short documents": lambda c: c.mask.kind == "document" and len(c.mask.doc_starts) >= 4,
    "zigzag": lambda c: c.layout == "zigzag",
    "striped": lambda c: c.layout == "striped",
    "fp16": lambda c: c.dtype == "fp16",
    "bf16": lambda c: c.dtype == "bf16",
    "large logits": lambda c: c.values == "large",
    "near-ties": lambda c: c.values == "near-tie",
    "custom softmax scale": lambda c: c.softmax_scale is not None,
    "batch 2": lambda c: c.batch == 2,
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_every_feature_is_drawn(feature):
    find(strategies.cases(), FEATURES[feature], settings=SEARCH)


def test_shrinks_to_smallest_world_shortest_sequence_fewest_heads_simplest_mask():
    c = find(strategies.cases(), lambda c: c.world_size >= 3 and c.mask.is_causal, settings=SHRINK)
    assert (c.world_size, c.seq_lens, c.group_offset) == (3, (1, 1, 1), 0)
    assert (c.heads_q, c.heads_kv, c.batch, c.head_dim) == (1, 1, 1, 1)
    assert c.mask.kind == "causal" and c.layout == "contiguous"
    assert (c.dtype, c.values, c.softmax_scale, c.seed) == ("fp32", "normal", None, 0)


def test_shrinks_a_length_condition_to_an_even_split():
    c = find(strategies.cases(), lambda c: c.total_len >= 10, settings=SHRINK)
    assert c.world_size == 1 and c.seq_lens == (10,)


def test_document_boundaries_shrink_to_fewest_documents():
    c = find(
        strategies.cases(),
        lambda c: c.mask.kind == "document" and len(c.mask.doc_starts) >= 3,
        settings=SHRINK,
    )
    assert c.mask.doc_starts == (0, 1, 2) and c.mask.causal and c.total_len == 3
    assert (c.heads_q, c.batch, c.head_dim, c.layout) == (1, 1, 1, "contiguous")


@pytest.mark.parametrize(
    "layout, lens, edges",
    [
        ("contiguous", (3, 2), [3]),
        ("zigzag", (4, 4), [2, 4, 6]),  # chunks r0 r1 | r1 r0: the seam at 4 is inside rank 1
        ("striped", (2, 2), [1, 2, 3]),
    ],
)
def test_boundary_positions(layout, lens, edges):
    assert strategies.boundary_positions(layout, lens) == edges


def test_refuses_capabilities_it_cannot_satisfy():
    caps = Capabilities(world_sizes=(16, 32))
    with pytest.raises(ValueError, match="world sizes"):
        find(strategies.cases(caps), lambda c: True, settings=SHRINK)


# -- sizes at scale (the default check's property-based stage: strategies.SIZES)
# -----------------------------

CI = strategies.SIZES["ci"]
SCALE = {
    "a rank past one 64-token tile, not a multiple": lambda c: any(
        n > 64 and n % 64 for n in c.seq_lens
    ),
    "a rank past two 128-token tiles": lambda c: any(n > 256 and n % 128 for n in c.seq_lens),
    "one token past a tile": lambda c: any(n % 64 == 1 and n > 64 for n in c.seq_lens),
    "one token short of a tile": lambda c: any(n % 64 == 63 for n in c.seq_lens),
    "bf16 positions past 256": lambda c: c.dtype == "bf16" and c.total_len > 256,
    "bf16 document starting past 256": lambda c: (
        c.dtype == "bf16" and c.mask.kind == "document" and max(c.mask.doc_starts) > 256
    ),
    "head_dim 64": lambda c: c.head_dim == 64,
    "head_dim 128": lambda c: c.head_dim == 128,
    "head_dim 80 or 96": lambda c: c.head_dim in (80, 96),
    "16+ query heads, GQA": lambda c: c.heads_q >= 16 and c.heads_kv > 1 and c.heads_q > c.heads_kv,
    "batch 3-4": lambda c: c.batch >= 3,
    "W=8 past a tile each": lambda c: c.world_size == 8 and min(c.seq_lens) > 64,
}


@pytest.mark.parametrize("what", sorted(SCALE))
def test_sizes_at_scale_reach(what):
    find(strategies.cases(sizes=CI), SCALE[what], settings=SEARCH)


@FAST
@given(strategies.cases(sizes=CI))
def test_sizes_at_scale_stay_within_their_caps(c):
    assert max(c.seq_lens) <= CI.max_local and c.total_len <= CI.max_total
    assert c.head_dim <= CI.max_head_dim and c.heads_q <= CI.max_heads and c.batch <= CI.max_batch
    work = c.batch * c.heads_q * max(c.head_dim, strategies.WORK_DIM) * c.total_len**2
    # batch, heads, head_dim give way
    assert work <= max(CI.max_work, strategies.WORK_DIM * c.total_len**2)


@FAST
@given(strategies.cases(Capabilities(tiles=(48,), head_dims=(64, 128)), sizes=CI))
def test_declared_head_dims_are_kept_and_tiles_aimed_at(c):
    assert c.head_dim in (64, 128)


def test_declared_tiles_are_aimed_at():
    find(
        strategies.cases(Capabilities(tiles=(48,)), sizes=CI),
        lambda c: any(n % 48 in (1, 47) and n > 48 for n in c.seq_lens),
        settings=SEARCH,
    )


def test_a_tile_tail_failure_shrinks_to_one_token_past_the_tile():
    c = find(
        strategies.cases(sizes=CI),
        lambda c: any(n > 64 and n % 64 for n in c.seq_lens),
        settings=SHRINK,
    )
    assert (c.world_size, c.seq_lens, c.heads_q, c.head_dim, c.batch) == (1, (65,), 1, 1, 1)


def test_a_dtype_limit_failure_shrinks_to_the_first_inexact_position():
    c = find(
        strategies.cases(sizes=CI),
        lambda c: c.dtype == "bf16" and c.mask.is_causal and c.total_len > 256,
        settings=SHRINK,
    )
    assert (c.world_size, c.total_len, c.mask.kind, c.dtype) == (1, 257, "causal", "bf16")


def test_a_head_dim_failure_shrinks_to_the_smallest_failing_head_dim():
    c = find(strategies.cases(sizes=CI), lambda c: c.head_dim > 64, settings=SHRINK)
    assert (c.world_size, c.seq_lens, c.head_dim) == (1, (1,), 80)
