"""The scale stage's cases (harness.search.scale): they reach every edge the issue names, aim at the
declared kernel tiles, and are adapted to what an implementation declares like the battery's."""

from __future__ import annotations

import pytest

from harness.context import Capabilities
from harness.impls.adapters.reference import REFERENCE_CAPABILITIES
from harness.impls.capabilities import unsupported
from harness.search.scale import base_cases, edge_lengths, scale_cases


def test_edge_lengths_are_just_past_1_2_4_tiles_and_no_multiple_of_one():
    assert edge_lengths((64, 128)) == [65, 129, 257, 513]
    assert edge_lengths((16,)) == [17, 33, 65]
    for tiles in ((64, 128), (16, 48), (128,), (3, 64)):
        for n in edge_lengths(tiles):
            assert all(n % t for t in tiles), (tiles, n)
        for t in tiles:
            for k in (1, 2, 4):
                assert any(k * t < n <= k * t + 8 for n in edge_lengths(tiles)), (tiles, t, k)


def _local_past(cases, tiles) -> set[tuple[int, int]]:
    return {
        (t, k)
        for c in cases
        for n in c.seq_lens
        for t in tiles
        for k in (1, 2, 4)
        if n > k * t and n % t
    }


PLAN = base_cases()


def test_the_plan_crosses_tiles_dtype_limits_and_real_head_dims():
    assert _local_past(PLAN, (64, 128)) == {(t, k) for t in (64, 128) for k in (1, 2, 4)}
    for dtype, limit in (("bf16", 256), ("fp16", 2048)):
        kinds = {c.mask.kind for c in PLAN if c.dtype == dtype and c.total_len > limit}
        assert {"causal", "window", "document"} <= kinds, dtype
    docs = [c for c in PLAN if c.mask.kind == "document"]
    assert any(s > 256 and c.dtype == "bf16" for c in docs for s in c.mask.doc_starts)
    assert any(s > 2048 and c.dtype == "fp16" for c in docs for s in c.mask.doc_starts)
    assert {64, 128} <= {c.head_dim for c in PLAN} and {80, 96} & {c.head_dim for c in PLAN}
    assert any(c.heads_q >= 16 and c.heads_q == 4 * c.heads_kv for c in PLAN)
    assert any(c.heads_q >= 16 and c.heads_q == 8 * c.heads_kv for c in PLAN)
    assert {3, 4} <= {c.batch for c in PLAN}
    assert {c.layout for c in PLAN} == {"contiguous", "zigzag", "striped"}
    assert sum(len(set(c.seq_lens)) > 1 for c in PLAN) >= 5
    assert {3, 4, 8} <= {c.world_size for c in PLAN} and max(c.pool_size for c in PLAN) <= 8
    assert len({c.seed for c in PLAN}) == len(PLAN)


def test_the_reference_runs_the_plan_unadapted():
    assert scale_cases(REFERENCE_CAPABILITIES) == PLAN


def test_declared_tiles_move_the_edges():
    caps = Capabilities(tiles=(32, 96))
    first = scale_cases(caps)[0]
    assert first.seq_lens == tuple(edge_lengths((32, 96)))
    assert _local_past([first], (32, 96)) == {(t, k) for t in (32, 96) for k in (1, 2, 4)}


NARROW = Capabilities(
    layouts=frozenset({"zigzag"}),
    masks=frozenset({"causal", "none"}),
    dtypes=frozenset({"bf16", "fp16"}),
    gqa=False,
    uneven=False,
    world_sizes=(2, 4),
    head_dims=(64, 128),
    zigzag_odd=False,
)


@pytest.mark.parametrize(
    "caps", [NARROW, Capabilities(heads_divisible_by_world=True)], ids=["narrow", "ulysses"]
)
def test_cases_are_adapted_to_what_is_declared(caps):
    cases = scale_cases(caps)
    assert len(cases) >= 5
    for c in cases:
        assert unsupported(caps, c) == [], c.summary()
    if caps is NARROW:  # adapted, yet still past the tiles and the dtypes' limits
        assert any(max(c.seq_lens) > 128 and max(c.seq_lens) % 64 for c in cases)
        assert any(c.dtype == "fp16" and c.total_len > 2048 for c in cases)


def test_dtype_and_deadline_apply_to_every_case():
    cases = scale_cases(REFERENCE_CAPABILITIES, dtype="fp32", deadline_s=12.0)
    assert {c.dtype for c in cases} == {"fp32"} and {c.deadline_s for c in cases} == {12.0}
