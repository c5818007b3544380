"""Third-party rings end to end on the harness's persistent gloo pool, judged against float64
attention."""

from __future__ import annotations

import pytest

from harness.case import Case
from harness.ranks.pool import RankPool
from harness.runner import run_case
from ring_impl.masks import MaskSpec

CAUSAL, NONE = MaskSpec("causal"), MaskSpec()
BASE = {"batch": 2, "heads_q": 2, "heads_kv": 2, "head_dim": 16, "deadline_s": 60.0}


def case(**kw) -> Case:
    return Case(**{**BASE, **kw})


def explain(res) -> str:
    worst = {
        c.tensor: max((d.error for d in res.checks if d.tensor == c.tensor), default=0)
        for c in res.checks
    }
    return f"{res.impl} {res.case.summary()}: {res.verdict} {res.detail} worst={worst}"


POOL_SIZE = 3  # ranks of the module's `pool` (tests/conftest.py)


TORCH_RING_CASES = {
    "w2-contiguous-causal": dict(world_size=2, seq_lens=(8, 8), layout="contiguous", mask=CAUSAL),
    "w3-zigzag-causal-gqa-bf16": dict(
        world_size=3,
        seq_lens=(6, 6, 6),
        layout="zigzag",
        mask=CAUSAL,
        heads_q=4,
        heads_kv=2,
        dtype="bf16",
    ),
    # odd local lengths are undeclared (zigzag_odd=False: one token per rank breaks torch) but let
    # through: L >= 3 runs right
    "w2-offset1-zigzag-odd-local": dict(
        world_size=2,
        seq_lens=(5, 5),
        layout="zigzag",
        mask=CAUSAL,
        group_offset=1,
        softmax_scale=0.2,
    ),
    "w3-contiguous-none-fp16": dict(
        world_size=3, seq_lens=(4, 4, 4), layout="contiguous", mask=NONE, dtype="fp16"
    ),
    "w1-causal": dict(world_size=1, seq_lens=(7,), layout="contiguous", mask=CAUSAL),
}


@pytest.mark.parametrize("impl", ["torch-ring", "torch-ring-alltoall"])
@pytest.mark.parametrize("key", list(TORCH_RING_CASES))
def test_torch_ring_passes(pool, impl, key):
    res = run_case(case(**TORCH_RING_CASES[key]), pool, impl)
    assert res.passed, explain(res)
    assert {c.tensor for c in res.checks} >= {"out", "lse", "dq", "dk", "dv"}


@pytest.mark.parametrize("impl", ["torch-ring", "torch-ring-alltoall"])
def test_torch_ring_one_token_per_rank_in_zigzag_is_torchs_own_error(pool, impl):
    """Why zigzag_odd=False: torch's causal zigzag ring halves each local shard with chunk(2), and
    one token does not halve. The run is let through (lets_run) and ends in torch's IndexError on
    every rank, not a hang."""
    res = run_case(case(world_size=2, seq_lens=(1, 1), layout="zigzag", mask=CAUSAL), pool, impl)
    assert res.verdict == "fail-stop", explain(res)
    assert "IndexError: tuple index out of range" in res.detail


def test_out_of_contract_case_is_refused_not_run(pool):
    res = run_case(
        case(world_size=2, seq_lens=(9, 7), layout="contiguous", mask=CAUSAL), pool, "torch-ring"
    )
    assert res.verdict == "fail-stop", explain(res)
    assert "unsupported here: uneven split [9, 7]" in res.detail


# ring-attention-pytorch addresses peers by global rank and barriers on the whole default group, so
# it gets its own pool, exactly as large as its ring: a second pool beside the module's `pool`.
@pytest.fixture(scope="module")
def pool2():
    pytest.importorskip("ring_attention_pytorch")
    with RankPool(size=2) as pool:
        pool.start()
        yield pool


RAP_CASES = {
    "contiguous-causal": dict(world_size=2, seq_lens=(8, 8), layout="contiguous", mask=CAUSAL),
    "striped-causal-gqa": dict(
        world_size=2, seq_lens=(6, 6), layout="striped", mask=CAUSAL, heads_q=4, heads_kv=2
    ),
    "striped-none-scale": dict(
        world_size=2, seq_lens=(6, 6), layout="striped", mask=NONE, softmax_scale=0.3
    ),
}


@pytest.mark.extra
@pytest.mark.parametrize("key", list(RAP_CASES))
def test_ring_attention_pytorch_forward_and_dq(pool2, key):
    """Our mapping (layout, scale, GQA head order) is right: out and dq match float64 on every
    rank."""
    res = run_case(case(**RAP_CASES[key]), pool2, "ring-attention-pytorch")
    checks = [c for c in res.checks if c.tensor in ("out", "dq")]
    assert len(checks) == 2 * 2 and all(c.passed for c in checks), explain(res)


@pytest.mark.extra
@pytest.mark.parametrize("key", list(RAP_CASES))
def test_ring_attention_pytorch_dk_dv_are_wrong(pool2, key):
    """ring-attention-pytorch 0.5.20: its ring-mode backward returns dk/dv as a (2, ...) stack
    ('dk, dv = dkv' after the last ring_pass), which autograd sums to the input shape: dk and dv are
    wrong on every rank, out and dq are right (cases/ring-attention-pytorch-dkdv-wrong-pair.yaml).
    When a release fixes it, this test fails: update the adapter's notes and the corpus case."""
    res = run_case(case(**RAP_CASES[key]), pool2, "ring-attention-pytorch")
    assert res.verdict == "silent-corruption", explain(res)
    failing = {(c.tensor, c.rank) for c in res.failed_checks()}
    assert failing == {(t, r) for t in ("dk", "dv") for r in (0, 1)}, explain(res)


@pytest.mark.extra
def test_ring_attention_pytorch_refuses_a_subgroup(pool):
    """It declares subgroups=False: the pool is sized to exactly W for it, and a ring inside a
    subgroup (global ranks 1..2 of 3) is refused with a clear error, not run wrongly."""
    pytest.importorskip("ring_attention_pytorch")
    res = run_case(
        case(world_size=2, seq_lens=(4, 4), layout="contiguous", mask=CAUSAL, group_offset=1),
        pool,
        "ring-attention-pytorch",
    )
    assert res.verdict == "fail-stop", explain(res)
    assert "runs only on the whole default process group" in res.detail
    assert pool.size == 3
