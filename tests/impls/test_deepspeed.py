"""DeepSpeed's Ulysses (`deepspeed.sequence.layer.DistributedAttention`), unmodified, on the harness's gloo
pool with torch's SDPA as the local attention: both call layouts end to end against the float64 oracle, the
tracker's bug classes at the pinned version (ci/requirements-thirdparty.txt), and the refusals. Skipped, with
one line, when deepspeed is not importable."""

from __future__ import annotations

import importlib.util

import pytest

from harness.case import make_case
from harness.ranks.pool import RankPool
from harness.runner import run_case

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (pip install --no-deps -r "
                                       "ci/requirements-thirdparty.txt)")
IMPLS = ("deepspeed-ulysses", "deepspeed-ulysses-seqfirst")


@pytest.fixture(scope="module")
def pool4():
    with RankPool(size=4) as pool:
        pool.start()
        yield pool


def _case(impl: str, **kw):
    base = dict(world_size=2, total_len=16, heads_q=4, heads_kv=2, head_dim=16, layout="contiguous",
                mask={"kind": "causal"}, dtype="fp32", seed=5, impl=impl, deadline_s=30.0)
    return make_case(**{**base, **kw})


def _explain(r) -> str:
    return f"{r.impl} {r.case.summary()}: {r.verdict} {r.detail[:400]}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [
    dict(),  # GQA, causal
    dict(world_size=4, total_len=32, heads_q=8, heads_kv=4, layout="zigzag", dtype="bf16"),
    # DeepSpeed #5808 / #5823: batch > 1 (fixed at the pin: this passes)
    dict(batch=3, layout="striped", mask={"kind": "window", "window": 3}),
    # DeepSpeed #6774 / #6797: head counts W does not divide take the uneven-heads path (right with the mesh)
    dict(world_size=4, total_len=32, heads_q=12, heads_kv=6),
    dict(heads_q=3, heads_kv=3, batch=2, mask={"kind": "none"}),
])
def test_ulysses_equals_the_float64_oracle(pool4, impl, shape):
    r = run_case(_case(impl, **shape), pool4, impl)
    assert r.passed, _explain(r)


def test_without_deepspeeds_mesh_the_uneven_heads_path_disagrees_on_the_split(pool4):
    """`uneven_heads_all2all` takes this rank's share from `groups._get_sequence_parallel_rank()`, which is 0 on
    every rank unless a mesh or an mpu is registered: the all-to-all's splits then differ between ranks (gloo
    refuses them). Even head counts never read it."""
    impl = "tests.helpers.deepspeed_impls:no_mesh"
    r = run_case(_case(impl, heads_q=3, heads_kv=3, mask={"kind": "none"}), pool4, impl, allow_import=True)
    assert r.verdict == "fail-stop" and "inLengthPerRank[myRank] == outLengthPerRank[myRank]" in r.detail, \
        _explain(r)
    even = run_case(_case(impl), pool4, impl, allow_import=True)
    assert even.passed, _explain(even)


def test_kv_heads_fewer_than_ranks_are_refused_with_one_line(pool4):
    r = run_case(_case("deepspeed-ulysses", world_size=4, total_len=32, heads_q=6, heads_kv=2), pool4,
                 "deepspeed-ulysses")
    assert r.verdict == "fail-stop" and "deepspeed-ulysses: unsupported here: 2 kv heads for W=4" in r.detail, \
        _explain(r)


@pytest.mark.parametrize("impl", IMPLS)
def test_unequal_lengths_abort_a_rank_in_the_all_to_all(pool4, impl):
    """DeepSpeed #7384 (S % W != 0): DistributedAttention splits every all-to-all equally, so ranks holding
    different lengths disagree on its sizes. Reported silent on NCCL; on gloo the shorter rank aborts (SIGABRT)
    in the first all-to-all. Let through on purpose (`lets_run`): the check's probe reports it."""
    c = make_case(world_size=2, seq_lens=(9, 7), batch=2, heads_q=4, heads_kv=2, head_dim=16, layout="contiguous",
                  mask={"kind": "causal"}, dtype="fp32", seed=5, impl=impl, deadline_s=30.0)
    r = run_case(c, pool4, impl)
    assert r.verdict == "fail-stop" and "SIGABRT" in r.detail and "all_to_all_single" in r.detail, _explain(r)
