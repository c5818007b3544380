"""Error localisation: case geometry, findings from synthetic error maps, and exact probe splits on
real ranks (the reference splits cleanly; the planted bug shows up in a block the mask hides)."""

from __future__ import annotations

import pytest
import torch

from harness.case import make_case
from harness.diagnose import localise
from harness.result import CaseResult, TensorCheck
from harness.runner import run_case

PLANTED = "tests.helpers.planted_impls:late_diagonal"


def test_geometry_of_a_zigzag_case():
    c = make_case(
        world_size=2,
        seq_lens=(4, 4),
        layout="zigzag",
        mask={"kind": "document", "doc_starts": [0, 5]},
    )
    assert localise.owners(c).tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert localise.row_order(c).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    # run edges at 0|1, 1|2 (rank change), 3|4 (zigzag seam), 5|6 (rank change), 7
    assert localise.shard_edges(c).nonzero().view(-1).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert localise.doc_edges(c).nonzero().view(-1).tolist() == [4, 5]
    steps = localise.step_of(c, "out")  # query on rank r meets key block b at step (r - b) mod W
    assert steps[0].tolist() == [0, 1] and steps[2].tolist() == [1, 0]
    assert localise.step_of(c, "dk")[2].tolist() == [1, 0]


def test_block_visibility_of_causal_contiguous():
    c = make_case(world_size=3, seq_lens=(1, 1, 1), mask={"kind": "causal"})
    by_key, by_query = localise.block_visibility(c)
    assert by_key.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert by_query.tolist() == [[True, True, True], [False, True, True], [False, False, True]]


def _fake_result(c, ratios: torch.Tensor) -> CaseResult:
    """A result whose out error map has the given per-token ratios (allowed = 1)."""
    checks = [TensorCheck("out", r, 0.0, 1.0, 0, {}, True) for r in range(c.world_size)]
    res = CaseResult(case=c, impl="fake", verdict="silent-corruption", checks=checks)
    res.maps["out"] = ratios.float().view(1, -1, 1)
    return res


def test_token_findings_name_rank_boundaries_only_when_errors_sit_there():
    c = make_case(world_size=2, seq_lens=(8, 8), mask={"kind": "causal"})
    at_edge = torch.zeros(16)
    at_edge[7] = at_edge[8] = 5.0
    loc = localise.localise(_fake_result(c, at_edge))
    assert any("2 of 2 failing tokens are at rank or chunk boundaries" in f for f in loc.findings)
    spread = torch.zeros(16)
    spread[[2, 4, 11, 13]] = 5.0
    loc = localise.localise(_fake_result(c, spread))
    assert not any("boundaries" in f for f in loc.findings)
    one_rank = torch.zeros(16)
    one_rank[[9, 12]] = 3.0
    assert any(
        "fails only on rank(s) [1] of 2" in f
        for f in localise.localise(_fake_result(c, one_rank)).findings
    )


def test_token_findings_name_document_boundaries():
    c = make_case(world_size=1, seq_lens=(20,), mask={"kind": "document", "doc_starts": [0, 10]})
    r = torch.zeros(20)
    r[[9, 10]] = 4.0
    assert any("document boundaries" in f for f in localise.localise(_fake_result(c, r)).findings)


@pytest.mark.parametrize(
    "where, words",
    [
        ("step2", "ring step 2"),
        ("diagonal", "causal-diagonal"),
        ("masked", "mask hides"),
    ],
)
def test_block_findings(where, words):
    c = make_case(world_size=4, seq_lens=(2, 2, 2, 2), mask={"kind": "causal"})
    steps = localise.step_of(c, "out")
    visible, _ = localise.block_visibility(c)
    grid = torch.full((8, 4), 0.1, dtype=torch.float64)
    cells = {"step2": steps == 2, "diagonal": steps == 0, "masked": ~visible}[where]
    grid[cells] = 50.0
    _, found = localise.block_findings(c, {"out": grid}, {"out": visible})
    assert any(words in f for f in found), found
    others = {"step2", "diagonal", "masked"} - {where}
    if where != "masked":  # the masked cells of a causal ring are also its late steps
        assert not any(w in " ".join(found) for w in others if w != "masked")


POOL_SIZE = 3  # ranks of the module's `pool` (tests/conftest.py)


def test_probes_split_the_output_exactly(pool):
    """Attention is linear in V: the kv-probe outputs of all key blocks sum to the real output."""
    from harness.impls import probe

    c = make_case(
        world_size=3,
        seq_lens=(3, 2, 4),
        layout="zigzag",
        mask={"kind": "causal"},
        heads_q=2,
        heads_kv=1,
    )
    full = run_case(c, pool, "reference", keep_shards=True, leak=False)
    parts = [
        run_case(
            c,
            pool,
            probe.spec("reference", "kv", b),
            allow_import=True,
            keep_shards=True,
            leak=False,
        )
        for b in range(3)
    ]
    for r in range(3):
        total = sum(p.shards[r]["out"].double() for p in parts)
        torch.testing.assert_close(total, full.shards[r]["out"].double(), rtol=0, atol=1e-5)


def test_reference_is_clean_and_planted_bug_is_a_leak_on_a_late_step(pool):
    c = make_case(
        world_size=3, seq_lens=(2, 2, 2), mask={"kind": "causal"}, heads_q=2, heads_kv=2, head_dim=8
    )
    bad = run_case(c, pool, PLANTED, allow_import=True)
    assert not bad.passed
    loc = localise.localise(bad, pool)
    assert any("mask hides" in f for f in loc.findings), loc.findings
    out = loc.blocks["out"]
    # rank 0's last query (token 1) sees key 2 (rank 1's block) at step 2: that hidden cell is hot
    assert out[1, 1] > 1 and not bool(loc.visible["out"][1, 1])
    # rank 2 has no late-step leak to make (its step-2 block is visible anyway)
    assert out[4:, :].max() <= 1
    assert loc.shares["blocks/out"]["masked_blocks"] > 0.3
    # the same probes on the reference: every cell is within tolerance
    ref = run_case(c, pool, "reference")
    # same tolerances, forced through the probes
    ref.checks, ref.verdict = bad.checks, "silent-corruption"
    clean = localise.probe_blocks(ref, pool)
    assert all(float(g.max()) <= 1 for g in clean.values())
