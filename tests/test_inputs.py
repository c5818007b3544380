"""Per-token seeded inputs: a rank's shard is bit-identical to slicing the parent's global
tensor."""

from __future__ import annotations

import pytest
import torch

from harness import inputs
from harness.case import make_case
from ring_impl.layouts import all_positions


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("values", ["normal", "large", "near-tie"])
def test_shard_equals_global_slice(layout, values):
    c = make_case(
        world_size=3,
        seq_lens=(70, 1, 90),
        layout=layout,
        heads_q=4,
        heads_kv=2,
        dtype="bf16",
        values=values,
        seed=7,
    )
    g = inputs.make_global(c)
    for pos in all_positions(layout, c.seq_lens):
        for name in inputs.NAMES:
            local = inputs.make(c, name, pos)
            assert torch.equal(local.view(torch.int16), g[name][:, pos].view(torch.int16))


def test_seed_changes_values_and_is_deterministic():
    c = make_case(world_size=1, total_len=10)
    a = inputs.make_global(c)["q"]
    assert torch.equal(a, inputs.make_global(c)["q"])
    assert not torch.equal(a, inputs.make_global(c.replace(seed=1))["q"])


def test_large_values_reach_large_scores():
    c = make_case(world_size=1, total_len=64, values="large", head_dim=16)
    g = inputs.make_global(c)
    s = torch.einsum("bqhd,bkhd->bhqk", g["q"], g["k"]) * c.scale
    assert float(s.abs().max()) > 100


def test_leak_queries_are_short_runs_inside_the_sequence():
    c = make_case(world_size=2, total_len=30, mask={"kind": "causal"}, seed=3)
    s = inputs.leak_queries(c)
    assert 1 <= s.numel() <= 6 and int(s.max()) < 30


def test_leak_queries_add_a_run_past_the_dtypes_exact_integers_and_keep_the_others():
    """Past 256 (bf16) / 2048 (fp16) a position computed in the input dtype rounds: one run of
    queries is there, drawn after the first two, so a case that stays within the exact integers
    keeps its queries."""
    short = make_case(world_size=2, total_len=250, mask={"kind": "causal"}, dtype="bf16", seed=3)
    long = short.replace(seq_lens=(300, 300))
    a, b = inputs.leak_queries(short).tolist(), inputs.leak_queries(long).tolist()
    assert len(a) <= 6 and max(a) < 250
    past = [q for q in b if q not in a]
    assert len(past) >= 1 and all(256 <= q < 600 for q in past)
    for dtype, limit in (("fp16", 2048), ("fp32", 1 << 24)):
        c = long.replace(dtype=dtype, seq_lens=(1100, 1100))
        extra = inputs.leak_queries(c).tolist()
        assert (max(extra) >= limit) == (c.total_len > limit + 4)
