"""DeepSpeed's sequence parallelism, unmodified, on the harness's gloo pool: Ulysses
(`DistributedAttention`, both call layouts, torch's SDPA), ALST (`UlyssesSPAttentionHF` around
transformers' SDPA function) and FPDT (`FPDT_Attention` over the flash-attn CPU stand-in), end to
end against the float64 oracle; the tracker's bug classes and our findings at the pinned versions
(ci/requirements-thirdparty.txt); the refusals. Skipped, with one line, when deepspeed (or, for
ALST, transformers) is not importable."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from harness.case import make_case
from harness.runner import run_case

pytestmark = [
    pytest.mark.extra,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (pip install --no-deps -r "
        "ci/requirements-thirdparty.txt)",
    ),
]
IMPLS = ("deepspeed-ulysses", "deepspeed-ulysses-seqfirst")


POOL_SIZE = 4  # ranks of the module's `pool` (tests/conftest.py)


def _case(impl: str, **kw):
    base = dict(
        world_size=2,
        total_len=16,
        heads_q=4,
        heads_kv=2,
        head_dim=16,
        layout="contiguous",
        mask={"kind": "causal"},
        dtype="fp32",
        seed=5,
        impl=impl,
        deadline_s=30.0,
    )
    return make_case(**{**base, **kw})


def _explain(r) -> str:
    return f"{r.impl} {r.case.summary()}: {r.verdict} {r.detail[:400]}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # GQA, causal
        dict(world_size=4, total_len=32, heads_q=8, heads_kv=4, layout="zigzag", dtype="bf16"),
        # DeepSpeed #5808 / #5823: batch > 1 (fixed at the pin: this passes)
        dict(batch=3, layout="striped", mask={"kind": "window", "window": 3}),
        # DeepSpeed #6774 / #6797: head counts W does not divide take the uneven-heads path (right
        # with the mesh)
        dict(world_size=4, total_len=32, heads_q=12, heads_kv=6),
        dict(heads_q=3, heads_kv=3, batch=2, mask={"kind": "none"}),
    ],
)
def test_ulysses_equals_the_float64_oracle(pool, impl, shape):
    r = run_case(_case(impl, **shape), pool, impl)
    assert r.passed, _explain(r)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "variant",
    [
        dict(sinks=(0.0, 2.5, 3.5, 5.0)),
        dict(softcap=2.0, values="large"),
        dict(alibi=True, layout="zigzag"),
        dict(head_dim_v=8, heads_q=4, heads_kv=4),
        dict(sinks=(3.0, 3.3, 3.6, 4.0), softcap=5.0, alibi=True, head_dim_v=24, dtype="bf16"),
    ],
)
def test_ulysses_runs_the_attention_variants_for_the_heads_each_rank_holds(pool, impl, variant):
    """Each rank holds a contiguous group of heads after the all-to-all: their sinks and slopes.
    The sinks' gradient lands on the heads' owners; their sum is the gradient (#53)."""
    r = run_case(_case(impl, **{**dict(world_size=2), **variant}), pool)
    assert r.passed, _explain(r)


def test_without_deepspeeds_mesh_the_uneven_heads_path_disagrees_on_the_split(pool):
    """`uneven_heads_all2all` takes this rank's share from `groups._get_sequence_parallel_rank()`,
    which is 0 on every rank unless a mesh or an mpu is registered: the all-to-all's splits then
    differ between ranks (gloo refuses them). Even head counts never read it."""
    impl = "tests.helpers.deepspeed_impls:no_mesh"
    r = run_case(
        _case(impl, heads_q=3, heads_kv=3, mask={"kind": "none"}), pool, impl, allow_import=True
    )
    assert (
        r.verdict == "fail-stop"
        and "inLengthPerRank[myRank] == outLengthPerRank[myRank]" in r.detail
    ), _explain(r)
    even = run_case(_case(impl), pool, impl, allow_import=True)
    assert even.passed, _explain(even)


def test_kv_heads_fewer_than_ranks_are_refused_with_one_line(pool):
    r = run_case(
        _case("deepspeed-ulysses", world_size=4, total_len=32, heads_q=6, heads_kv=2),
        pool,
        "deepspeed-ulysses",
    )
    assert (
        r.verdict == "fail-stop"
        and "deepspeed-ulysses: unsupported here: 2 kv heads for W=4" in r.detail
    ), _explain(r)


@pytest.mark.parametrize("impl", IMPLS)
def test_unequal_lengths_abort_a_rank_in_the_all_to_all(pool, impl):
    """DeepSpeed #7384 (S % W != 0): DistributedAttention splits every all-to-all equally, so ranks
    holding different lengths disagree on its sizes. Reported silent on NCCL; on gloo the shorter
    rank aborts (SIGABRT) in the first all-to-all. Let through on purpose (`lets_run`): the check's
    probe reports it."""
    c = make_case(
        world_size=2,
        seq_lens=(9, 7),
        batch=2,
        heads_q=4,
        heads_kv=2,
        head_dim=16,
        layout="contiguous",
        mask={"kind": "causal"},
        dtype="fp32",
        seed=5,
        impl=impl,
        deadline_s=30.0,
    )
    r = run_case(c, pool, impl)
    assert r.verdict == "fail-stop" and "SIGABRT" in r.detail and "all_to_all_single" in r.detail, (
        _explain(r)
    )


needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (ALST's attention function)",
)


@needs_transformers
@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # GQA, causal
        # kv heads replicated (W > kv heads), b > 1
        dict(world_size=4, total_len=32, heads_q=8, heads_kv=2, batch=2),
        dict(
            world_size=4, total_len=32, heads_q=8, heads_kv=4, dtype="bf16", mask={"kind": "none"}
        ),
        dict(total_len=24, batch=3, dtype="fp16", softmax_scale=0.3),
    ],
)
def test_alst_equals_the_float64_oracle(pool, shape):
    r = run_case(_case("deepspeed-alst", **shape), pool, "deepspeed-alst")
    assert r.passed, _explain(r)


@needs_transformers
def test_alst_keeps_its_sequence_length_between_calls_of_other_lengths(pool):
    """One ALST module per rank and shape serves every case, as a model's layer serves every batch:
    with `seq_length_is_variable` it takes each call's length (a module fixed to the first length
    would assert)."""
    for total_len in (16, 40, 8, 16):
        r = run_case(_case("deepspeed-alst", total_len=total_len), pool, "deepspeed-alst")
        assert r.passed, _explain(r)


@needs_transformers
@pytest.mark.parametrize(
    "mask",
    [
        {"kind": "document", "doc_starts": [0, 5, 11], "causal": True},
        {"kind": "window", "window": 3},
    ],
)
def test_alst_drops_every_mask_but_causal(pool, mask):
    """The wrapper ALST registers with transformers drops the model's 4D mask (ulysses_sp.py:
    `attention_mask = None`), so with SDPA packed documents and sliding windows silently become
    plain causal attention over the whole sequence (position_ids restarting at each document change
    nothing for SDPA)."""
    r = run_case(_case("deepspeed-alst", mask=mask), pool, "deepspeed-alst")
    assert r.verdict == "silent-corruption", _explain(r)


@needs_transformers
def test_alst_with_unequal_lengths_aborts_a_rank_like_ulysses(pool):
    """DeepSpeed #7384's class in ALST: each rank takes its own length as `local_seq_length`, so the
    equal splits of its all-to-all disagree; on gloo the shorter rank aborts. Let through on purpose
    (`lets_run`)."""
    c = make_case(
        world_size=2,
        seq_lens=(9, 7),
        batch=2,
        heads_q=4,
        heads_kv=4,
        head_dim=16,
        layout="contiguous",
        mask={"kind": "causal"},
        dtype="fp32",
        seed=5,
        impl="deepspeed-alst",
        deadline_s=30.0,
    )
    r = run_case(c, pool, "deepspeed-alst")
    assert r.verdict == "fail-stop" and "SIGABRT" in r.detail, _explain(r)


@needs_transformers
def test_alst_refuses_other_layouts_with_one_line(pool):
    r = run_case(_case("deepspeed-alst", layout="zigzag"), pool, "deepspeed-alst")
    assert (
        r.verdict == "fail-stop" and "deepspeed-alst: unsupported here: layout zigzag" in r.detail
    ), _explain(r)


@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # bf16 GQA, 2 chunks of 4 tokens a rank
        # 4 chunks
        dict(
            world_size=4,
            total_len=48,
            heads_q=8,
            heads_kv=4,
            layout="zigzag",
            dtype="fp16",
            batch=2,
        ),
        dict(world_size=3, total_len=27, heads_q=6, heads_kv=3, layout="striped"),  # 3 chunks
        # one chunk (7 tokens a rank), a scale FPDT cannot take
        dict(total_len=14, head_dim=32, softmax_scale=0.2),
        dict(world_size=4, total_len=32, heads_q=10, heads_kv=5),  # DeepSpeed's uneven-heads path
    ],
)
def test_fpdt_equals_the_float64_oracle(pool, shape):
    r = run_case(_case("deepspeed-fpdt", **{"dtype": "bf16", **shape}), pool, "deepspeed-fpdt")
    assert r.passed, _explain(r)


@pytest.mark.parametrize(
    ("total", "world_size", "chunks"), [(24, 2, 3), (32, 4, 4), (12, 3, 1), (16, 1, 4)]
)
def test_fpdt_rows_are_deepspeeds_own_input_layout(total, world_size, chunks):
    """The adapter's reshard targets the rows `FPDT_InputConstruct.generate` gives each rank
    (DeepSpeed's own code, no process group needed)."""
    import torch
    from deepspeed.sequence.fpdt_layer import FPDT_InputConstruct

    from harness.impls.adapters.deepspeed_fpdt import fpdt_rows

    tokens = torch.arange(total)[None]
    args = SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=total // chunks)
    for r in range(world_size):
        theirs = FPDT_InputConstruct(
            tokens, None, None, None, None, args, world_size, r
        ).generate()[0][0]
        assert theirs.tolist() == fpdt_rows(total, world_size, r, chunks).tolist()


def test_fpdt_merge_overflows_with_large_scores(pool):
    """FPDT merges chunk results with lse + log1p(exp(block_lse - lse)) (fpdt_layer.py
    `_update_out_and_lse`), the formula ring-flash-attention replaced (its PR #30): once a later
    chunk's lse exceeds the running one by ~88 the exp overflows float32, the row's lse becomes inf
    and its output NaN or 0. Scores of 50-200 (values "large") do it; the same case passes with only
    that function made overflow-free."""
    c = _case(
        "deepspeed-fpdt",
        world_size=4,
        total_len=32,
        heads_q=4,
        heads_kv=4,
        head_dim=32,
        dtype="fp16",
        values="large",
        seed=17,
    )
    r = run_case(c, pool, "deepspeed-fpdt")
    assert r.verdict == "silent-corruption" and "xinf" in r.detail, _explain(r)
    impl = "tests.helpers.deepspeed_impls:fpdt_stable_merge"
    fixed = run_case(c, pool, impl, allow_import=True)
    assert fixed.passed, _explain(fixed)


def test_a_row_that_sees_no_key_gets_zero_whatever_sdpa_leaves_in_it(monkeypatch):
    """The Ulysses adapters' local attention zeroes rows whose mask hides every key. torch 2.13's
    CPU SDPA returns 0 there by itself; torch 2.11's CUDA SDPA (bf16, a boolean mask) did not, on an
    H200 (docs/third-party.md): this stands in for such a kernel."""
    import torch

    from harness.case import make_case
    from harness.context import RunContext
    from harness.impls.adapters.deepspeed import local_attention

    # query 1 sees no key
    c = make_case(world_size=1, total_len=2, mask={"not": {"kind": "causal"}})
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, k, v, **kw: real(q, k, v, **kw) + 1.0,
    )  # every row nonzero
    ctx = RunContext(
        group=None,
        rank=0,
        world_size=1,
        global_ranks=(0,),
        layout="contiguous",
        lengths=(2,),
        all_positions=(torch.arange(2),),
        mask=c.mask,
        softmax_scale=0.5,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    q, k, v = (torch.randn(1, 2, 1, 8) for _ in range(3))
    out = local_attention(torch.arange(2), ctx, seq_dim=1)(q, k, v)  # [b, s, h, d]
    assert out[0, 1].abs().max() == 0 and out[0, 0].abs().min() > 0
