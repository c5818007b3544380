"""Declared capabilities, mask/argument mappings, and refusals outside the declaration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.context import DTYPES, Capabilities, RunContext
from harness.impls import registry
from harness.impls.adapters import (
    _common,
    deepspeed,
    ring_attention_pytorch,
    ring_flash_attn,
    te_cp,
    torch_cp,
    torch_ring,
    yunchang,
)
from harness.impls.registry import ImplError
from ring_impl.layouts import LAYOUTS, all_positions
from ring_impl.masks import MASK_FEATURES, MaskSpec


def make_ctx(layout="contiguous", lengths=(8, 8), mask=None, rank=0, device="cpu", scale=0.25):
    mask = MaskSpec("causal") if mask is None else mask
    pos = tuple(all_positions(layout, list(lengths)))
    return RunContext(
        group=None,
        rank=rank,
        world_size=len(lengths),
        global_ranks=tuple(range(len(lengths))),
        layout=layout,
        lengths=tuple(lengths),
        all_positions=pos,
        mask=mask,
        softmax_scale=scale,
        dtype=torch.float32,
        device=torch.device(device),
    )


def caps_of(name: str) -> Capabilities:
    caps = registry.declared_capabilities(name)
    assert caps is not None, name
    return caps


@pytest.mark.parametrize("name", registry.builtin_names())
def test_declarations_are_well_formed(name):
    c = caps_of(name)
    assert c.layouts and c.layouts <= set(LAYOUTS)
    assert c.masks and c.masks <= set(MASK_FEATURES)
    assert c.dtypes and c.dtypes <= set(DTYPES)
    assert c.backends and c.backends <= {"gloo", "nccl"}
    assert 1 <= c.world_sizes[0] <= c.world_sizes[1]


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in registry.builtin_names()
        if n.startswith(("ring-flash-attn", "te-cp", "yunchang", "torch-cp"))
    ],
)
def test_gpu_only_adapters_declare_nccl_and_no_fp32_flash(name):
    """Flash-attn rings run on gloo where the CPU stand-in serves the ranks (no real flash-attn
    importable), on NCCL where a real flash-attn is; the others are GPU-only."""
    from harness.kernels import flash_standin

    c = caps_of(name)
    on_standin = name.startswith(("ring-flash-attn", "yunchang")) and flash_standin.serves_gloo()
    assert c.backends == ({"gloo"} if on_standin else {"nccl"})
    if not name.startswith("torch-cp"):
        assert c.dtypes == {"fp16", "bf16"} and c.head_dims is not None and 64 in c.head_dims


def test_specific_claims():
    ref = caps_of("reference")
    assert ref.returns_lse and ref == Capabilities(returns_lse=True, masks=frozenset(MASK_FEATURES), idle_ranks=True)
    rap = caps_of("ring-attention-pytorch")
    assert rap.dtypes == {"fp32"} and not rap.uneven and rap.world_sizes[0] == 2
    assert rap.layouts == {"contiguous", "striped"} and rap.masks == {"none", "causal"}
    tr = caps_of("torch-ring")
    assert tr.backends == {"gloo"} and tr.returns_lse and tr.layouts == {"contiguous", "zigzag"}
    assert caps_of("torch-ring-alltoall") == tr
    assert caps_of("ring-flash-attn-zigzag").masks == {"causal"}
    assert caps_of("ring-flash-attn-stripe").masks == {"causal"}
    assert caps_of("ring-flash-attn").masks == {"none", "causal"}
    assert caps_of("ring-flash-attn-llama3").masks == {"none", "causal", "window", "document", "expr", "and", "full",
                                                       "per-document"}  # no window-right (two-sided)
    assert caps_of("yunchang-ulysses").masks == {"none", "causal", "window", "expr", "and", "full", "window-right"}
    assert "window" not in caps_of("te-cp-p2p").masks
    assert "window" in caps_of("te-cp-a2a").masks and "window" in caps_of("te-cp-all-gather").masks
    assert "window-right" in caps_of("te-cp-a2a").masks and "document" not in caps_of("te-cp-all-gather").masks
    assert all(caps_of(n).layouts == {"zigzag"} for n in te_cp.VARIANTS if not n.endswith("-thd"))
    assert caps_of("te-cp-p2p-thd").layouts == set(LAYOUTS)  # it reshards to TE's THD partition itself
    assert caps_of("yunchang-usp").layouts == {"contiguous"} and caps_of("yunchang-usp").world_sizes[0] == 4
    assert not any(caps_of(n).uneven for n in registry.builtin_names() if n not in ("reference", "flash-ring"))


def test_require_supported_lists_every_reason_on_one_line():
    caps = caps_of("ring-attention-pytorch")
    ctx = make_ctx(layout="zigzag", lengths=(9, 7), mask=MaskSpec("window", window=2))
    q = torch.zeros(1, 9, 4, 8, dtype=torch.bfloat16)
    k = torch.zeros(1, 9, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ImplError) as e:
        _common.require_supported("ring-attention-pytorch", ctx, caps, q, k)
    msg = str(e.value)
    assert msg.startswith("ring-attention-pytorch: unsupported here: ")
    for part in ("layout zigzag", "mask window", "dtype bf16", "uneven split [9, 7]"):
        assert part in msg
    assert "GQA" not in msg and "\n" not in msg
    assert _common.unsupported_reasons(make_ctx(), caps, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)) == []


def test_require_supported_backend_and_world():
    caps = caps_of("torch-cp")
    why = _common.unsupported_reasons(
        make_ctx(lengths=(8,) * 9), caps, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)
    )
    assert any(w.startswith("backend gloo") for w in why)
    assert any(w.startswith("world size 9") for w in why)
    assert any(w.startswith("dtype fp32") for w in why)


def test_gqa_refused_only_where_undeclared():
    q, k = torch.zeros(1, 8, 4, 16), torch.zeros(1, 8, 2, 16)
    assert any("GQA" in w for w in _common.unsupported_reasons(make_ctx(), caps_of("torch-cp"), q, k))
    assert not any("GQA" in w for w in _common.unsupported_reasons(make_ctx(), caps_of("torch-ring"), q, k))


def test_whole_world_refusal():
    ctx = make_ctx()
    ctx = RunContext(**{**ctx.__dict__, "global_ranks": (1, 2)})
    with pytest.raises(ImplError, match="runs only on the whole default process group"):
        _common.require_whole_world("ring-attention-pytorch", ctx)


def test_ring_attention_pytorch_arguments():
    ctx = make_ctx(layout="striped", lengths=(6, 6, 6), mask=MaskSpec("causal"))
    args = ring_attention_pytorch.library_args(ctx, 6)
    assert args == {
        "causal": True,
        "bucket_size": 6,
        "ring_reduce_col": True,
        "striped_ring_attn": True,
        "ring_size": 3,
    }
    args = ring_attention_pytorch.library_args(make_ctx(mask=MaskSpec()), 8)
    assert args["causal"] is False and args["striped_ring_attn"] is False and args["bucket_size"] == 8
    assert ring_attention_pytorch.q_prescale(64**-0.5, 64) == pytest.approx(1.0)
    assert ring_attention_pytorch.q_prescale(0.1, 16) == pytest.approx(0.4)


def test_gqa_head_permutation_round_trip_and_convention():
    q = torch.randn(2, 3, 6, 4)
    assert torch.equal(_common.tiled_to_grouped(_common.grouped_to_tiled(q, 2), 2), q)
    assert torch.equal(_common.grouped_to_tiled(q, 6), q)  # no GQA: untouched
    for heads, kv in ((6, 2), (8, 2), (8, 4), (4, 1)):
        g = heads // kv
        src = _common.grouped_to_tiled(torch.arange(heads).float().view(1, 1, heads, 1), kv).view(-1).long()
        # tiled slot j uses kv head j % kv; it holds grouped head src[j], whose kv head is src[j] // G
        assert torch.equal(src // g, torch.arange(heads) % kv), (heads, kv)


def test_torch_ring_load_balance_rule():
    assert torch_ring.load_balance(make_ctx(layout="zigzag", mask=MaskSpec("causal")))
    assert not torch_ring.load_balance(make_ctx(layout="zigzag", mask=MaskSpec()))
    assert not torch_ring.load_balance(make_ctx(layout="contiguous", mask=MaskSpec("causal")))
    assert torch_cp.load_balance is torch_ring.load_balance


def test_torch_ring_unsupported_torch_version_is_one_line(monkeypatch):
    monkeypatch.setattr(torch_ring, "MODULES", ("no_such_module_xyz",))
    with pytest.raises(ImplError) as e:
        torch_ring.load_private_api()
    msg = str(e.value)
    assert msg.startswith(f"torch-ring: unsupported torch version {torch.__version__} (missing ")
    assert "_templated_ring_attention" in msg and "\n" not in msg
    with pytest.raises(ImplError, match="unsupported torch version"):
        registry.resolve("torch-ring")


def test_torch_ring_missing_symbol(monkeypatch):
    mod = torch_ring.load_private_api()
    monkeypatch.delattr(mod, "_templated_ring_attention_backward")
    with pytest.raises(ImplError, match=r"missing _templated_ring_attention_backward\)$"):
        torch_ring.load_private_api()


def test_flash_mask_of_the_original_kinds():
    from harness.impls.adapters._common import FlashMask, flash_mask

    assert flash_mask(MaskSpec("window", window=5), 16) == FlashMask(causal=True, window=(5, 0))
    assert flash_mask(MaskSpec("causal"), 16) == FlashMask(causal=True)
    assert flash_mask(MaskSpec(), 16) == FlashMask()
    doc = flash_mask(MaskSpec("document", doc_starts=(0, 3, 10), causal=False), 16)
    assert doc == FlashMask((0, 3, 10), False) and doc.cu_seqlens(16).tolist() == [0, 3, 10, 16]
    assert doc.cu_seqlens(16).dtype == torch.int32 and FlashMask().cu_seqlens(16).tolist() == [0, 16]


def _flash_visible(fm, total: int) -> torch.Tensor:
    """What flash-attn varlen computes for `fm` over a whole stream (every document's queries and keys,
    Lq = Lk per document): the stand-in's copy of flash-attn 2.8.3's window arithmetic, document by document."""
    import importlib.util

    from harness.kernels import flash_standin

    path = flash_standin.STANDIN_DIR / "flash_attn" / "_cpu_core.py"
    spec = importlib.util.spec_from_file_location("_rh_cpu_core", path)
    core = importlib.util.module_from_spec(spec)  # torch only: loaded alone, no flash_attn package installed
    spec.loader.exec_module(core)
    bounds = fm.cu_seqlens(total).tolist()
    max_k = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    window = core.normalise_window(fm.causal, *fm.window, max_k)
    out = torch.zeros(total, total, dtype=torch.bool)
    for a, b in zip(bounds, bounds[1:], strict=False):
        out[a:b, a:b] = core.visible(b - a, b - a, 0, b - a, window)
    return out


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.data())
def test_flash_mask_is_the_mask_for_everything_it_expresses(data):
    """Every mask drawn from what `flash_mask` claims (conjunctions of full, causal, two-sided windows,
    documents, per-document) maps, and flash-attn's visibility of the mapping is the mask, position by
    position; what flash-attn cannot express maps to None."""
    from harness.impls.adapters._common import FLASH_MASK_FEATURES, flash_mask
    from harness.search.strategies import masks
    from ring_impl.masks import allowed

    total = data.draw(st.integers(1, 40))
    spec = data.draw(masks(total, tuple(sorted(FLASH_MASK_FEATURES)), boundaries=(0, total // 3, total // 2)))
    fm = flash_mask(spec, total)
    assert fm is not None, spec.describe()
    pos = torch.arange(total)
    want = allowed(spec, pos, pos)
    want = torch.ones(total, total, dtype=torch.bool) if want is None else want
    assert torch.equal(_flash_visible(fm, total), want), (spec.describe(), fm)


def test_flash_mask_refuses_what_flash_attn_cannot_express():
    from harness.impls.adapters._common import flash_mask
    from ring_impl.masks import and_, not_, or_, prim

    for expr in (or_(prim("causal"), prim("prefix", 3)), not_(prim("causal")), prim("chunked", 4),
                 and_(prim("causal"), prim("inverse-causal")), prim("dilated", 4, 2, 0)):
        assert flash_mask(MaskSpec.of(expr), 16) is None, expr


def test_te_mask_arguments_and_preconditions():
    assert te_cp.mask_args(make_ctx(mask=MaskSpec())) == {
        "attn_mask_type": "no_mask",
        "window_size": (-1, -1),
    }
    assert te_cp.mask_args(make_ctx(mask=MaskSpec("causal")))["attn_mask_type"] == "causal"
    assert te_cp.mask_args(make_ctx(mask=MaskSpec("window", window=7))) == {
        "attn_mask_type": "causal",
        "window_size": (7, 0),
    }
    with pytest.raises(ImplError):
        te_cp.mask_args(make_ctx(mask=MaskSpec("document", doc_starts=(0, 4))))
    from ring_impl.masks import and_, prim

    assert te_cp.mask_args(make_ctx(mask=MaskSpec.of(prim("window", 3, 2)))) == {
        "attn_mask_type": "no_mask", "window_size": (3, 2)}
    assert te_cp.mask_args(make_ctx(mask=MaskSpec.of(and_(prim("window", 3, 2), prim("causal"))))) == {
        "attn_mask_type": "causal", "window_size": (3, 0)}
    assert te_cp.mask_args(make_ctx(mask=MaskSpec("document", doc_starts=(0, 4), causal=False)), thd=True) == {
        "attn_mask_type": "padding", "window_size": (-1, -1)}
    assert te_cp.mask_args(make_ctx(mask=MaskSpec("causal")), thd=True)["attn_mask_type"] == "padding_causal"
    with pytest.raises(ImplError, match="not divisible by 2\\*W"):
        te_cp.check_shapes("te-cp-p2p", make_ctx(lengths=(5, 5)), 4, 4)
    with pytest.raises(ImplError, match="a2a needs head counts divisible"):
        te_cp.check_shapes("te-cp-a2a", make_ctx(lengths=(4, 4, 4)), 4, 4)
    te_cp.check_shapes("te-cp-p2p", make_ctx(lengths=(4, 4, 4)), 4, 4)


def _te_visible(args: dict, total: int) -> torch.Tensor:
    """TE's visibility for self-attention (equal lengths: its bottom-right diagonal is ours): causal cuts
    j > i; window_size (left, right) keeps i - left <= j <= i + right, -1 unlimited."""
    i, j = torch.arange(total).view(-1, 1), torch.arange(total).view(1, -1)
    left, right = args["window_size"]
    seen = torch.ones(total, total, dtype=torch.bool)
    if args["attn_mask_type"] == "causal":
        seen &= j <= i
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    return seen


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_te_window_arguments_are_the_mask_for_everything_declared(data):
    """Every mask drawn from what te-cp-a2a / -all-gather declare (none, causal, one- and two-sided windows,
    their conjunctions) maps to TE arguments whose visibility is the mask, position by position."""
    from harness.search.strategies import masks
    from ring_impl.masks import allowed

    total = data.draw(st.integers(1, 40))
    spec = data.draw(masks(total, tuple(sorted(caps_of("te-cp-a2a").masks)), boundaries=(0, total // 2)))
    args = te_cp.mask_args(make_ctx(mask=spec, lengths=(total,)))
    pos = torch.arange(total)
    want = allowed(spec, pos, pos)
    want = torch.ones(total, total, dtype=torch.bool) if want is None else want
    assert torch.equal(_te_visible(args, total), want), (spec.describe(), args)


def test_yunchang_ring_types_cover_declared_layouts():
    assert set(yunchang.RING_TYPE) == caps_of("yunchang-ring").layouts


def test_require_supported_refuses_a_subgroup_where_undeclared():
    caps = caps_of("ring-attention-pytorch")
    ctx = RunContext(**{**make_ctx().__dict__, "global_ranks": (1, 2)})
    q = torch.zeros(1, 8, 2, 8)
    why = _common.unsupported_reasons(ctx, caps, q, q)
    assert why == ["ring in a subgroup (global ranks [1, 2]): runs only on the whole default process group"]
    assert _common.unsupported_reasons(ctx, caps_of("torch-ring"), q, q) == []


CASE_VS_RUN = [
    # (implementation, case fields) -> the same feature keys on the case side and inside the run
    ("ring-attention-pytorch", dict(layout="zigzag", seq_lens=(9, 7), mask=MaskSpec("window", window=2),
                                    dtype="bf16", heads_q=4, heads_kv=2)),
    ("ring-flash-attn", dict(seq_lens=(8,) * 9, heads_q=4, heads_kv=1, head_dim=13)),
    ("torch-cp", dict(seq_lens=(8, 8), heads_q=4, heads_kv=1)),
    ("ring-attention-pytorch", dict(seq_lens=(8, 8), group_offset=1)),
    ("reference", dict(seq_lens=(5, 1), layout="striped", dtype="fp16", heads_q=6, heads_kv=3)),
    ("torch-ring", dict(layout="zigzag", seq_lens=(3, 3), mask=MaskSpec("causal"))),
    ("ring-flash-attn-zigzag", dict(layout="zigzag", seq_lens=(5, 5, 5), dtype="bf16", head_dim=16)),
    ("yunchang-ulysses", dict(seq_lens=(8, 8, 8), dtype="bf16", heads_q=4, heads_kv=1, head_dim=16)),
]


@pytest.mark.parametrize("name,fields", CASE_VS_RUN)
def test_one_rule_for_cases_and_runs(name, fields):
    """`capabilities.unsupported` (case) and `require_supported` (run) are one rule: the same keys,
    apart from the backend, which only the run side knows."""
    from harness.case import make_case
    from harness.dtypes import TORCH_DTYPES
    from harness.impls.capabilities import missing_features, unsupported

    caps = caps_of(name)
    c = make_case(impl=name, world_size=len(fields["seq_lens"]), **fields)
    case_keys = unsupported(caps, c)
    ctx = RunContext(**{**make_ctx(layout=c.layout, lengths=c.seq_lens, mask=c.mask).__dict__,
                        "global_ranks": tuple(range(c.group_offset, c.group_offset + c.world_size))})
    q = torch.zeros(1, c.seq_lens[0], c.heads_q, c.head_dim, dtype=TORCH_DTYPES[c.dtype])
    k = torch.zeros(1, c.seq_lens[0], c.heads_kv, c.head_dim, dtype=TORCH_DTYPES[c.dtype])
    run_keys = missing_features(
        caps, layout=ctx.layout, mask_kind=ctx.mask.kind, dtype=c.dtype, world_size=ctx.world_size,
        heads_q=c.heads_q, heads_kv=c.heads_kv, lengths=ctx.lengths, head_dim=c.head_dim,
        subgroup=_common.is_subgroup(ctx), backend=_common.backend_of(ctx),
    )
    assert [f for f in run_keys if not f.startswith("backend:")] == case_keys
    assert unsupported(caps, c, backend="gloo") == run_keys
    assert len(_common.unsupported_reasons(ctx, caps, q, k)) == len(run_keys)
    if name == "reference":
        assert case_keys == run_keys == []


def test_feature_keys_and_words():
    from harness.impls.capabilities import feature_words, missing_features

    caps = Capabilities(layouts=frozenset({"contiguous"}), masks=frozenset({"causal"}), dtypes=frozenset({"bf16"}),
                        gqa=False, uneven=False, backends=frozenset({"nccl"}), head_dims=(64,), subgroups=False)
    keys = missing_features(caps, layout="zigzag", mask_kind="window", dtype="fp32", world_size=9, heads_q=4,
                            heads_kv=1, lengths=(5, 1), head_dim=13, subgroup=None, backend=None)
    assert keys == ["layout:zigzag", "mask:window", "dtype:fp32", "world:9", "mqa", "uneven", "head_dim:13"]
    assert "gqa" in missing_features(caps, layout="contiguous", mask_kind="causal", dtype="bf16", world_size=2,
                                     heads_q=4, heads_kv=2, lengths=(8, 8), head_dim=64, subgroup=None, backend=None)
    words = [feature_words(f, caps, heads_q=4, heads_kv=1, lengths=(5, 1)) for f in keys]
    assert words == ["layout zigzag", "mask window", "dtype fp32", "world size 9 (supports 1..8)",
                     "GQA (4 query heads, 1 kv heads)", "uneven split [5, 1]", "head_dim 13"]
    assert missing_features(caps, layout="contiguous", mask_kind="causal", dtype="bf16", world_size=2, heads_q=2,
                            heads_kv=2, lengths=(8, 8), head_dim=64, subgroup=True, backend="gloo") == [
        "subgroup", "backend:gloo"]
    assert feature_words("backend:gloo", caps) == "backend gloo (supports nccl)"


# -- zigzag with an odd local length, head counts the world size divides (issues #10, #11) ----------------

ODD_HEADS = Capabilities(zigzag_odd=False, heads_divisible_by_world=True)
ODD = Capabilities(zigzag_odd=False)


def _missing(caps, layout="zigzag", lengths=(4, 4), heads=(4, 4), **kw):
    from harness.impls.capabilities import missing_features

    args = dict(layout=layout, mask_kind="causal", dtype="fp32", world_size=len(lengths), heads_q=heads[0],
                heads_kv=heads[1], lengths=lengths, head_dim=16, subgroup=None, backend=None)
    return missing_features(caps, **{**args, **kw})


def test_zigzag_odd_key_and_words():
    from harness.impls.capabilities import feature_words

    assert _missing(ODD_HEADS, lengths=(3, 3)) == ["zigzag-odd"]
    assert _missing(ODD_HEADS, lengths=(1,) * 8, heads=(8, 8)) == ["zigzag-odd"]  # torch's IndexError case
    assert _missing(ODD_HEADS, lengths=(3,), heads=(1, 1)) == ["zigzag-odd"]  # W=1: two chunks of one rank too
    assert _missing(ODD_HEADS, lengths=(4, 2)) == []  # uneven is declared here, both lengths even
    assert _missing(ODD_HEADS, lengths=(4, 3)) == ["zigzag-odd"]
    assert _missing(ODD_HEADS, layout="contiguous", lengths=(3, 3)) == []
    assert _missing(ODD_HEADS, layout="striped", lengths=(3, 3)) == []
    assert _missing(Capabilities(), lengths=(3, 3)) == []  # declared by default
    assert _missing(Capabilities(zigzag_odd=False, uneven=False), lengths=(4, 3)) == ["uneven", "zigzag-odd"]
    assert feature_words("zigzag-odd", ODD_HEADS, lengths=(3, 3)) == "zigzag with an odd local length [3, 3]"


def test_heads_key_and_words():
    from harness.impls.capabilities import feature_words

    assert _missing(ODD_HEADS, lengths=(4, 4, 4), heads=(4, 1)) == ["heads"]
    assert _missing(ODD_HEADS, lengths=(4, 4, 4), heads=(6, 2)) == ["heads"]  # kv heads too
    assert _missing(ODD_HEADS, lengths=(4, 4, 4), heads=(6, 3)) == []
    assert _missing(ODD_HEADS, lengths=(4,), heads=(5, 1)) == []  # W=1 divides everything
    assert _missing(Capabilities(), lengths=(4, 4, 4), heads=(4, 1)) == []  # not required by default
    assert _missing(Capabilities(gqa=False, heads_divisible_by_world=True), lengths=(4, 4, 4), heads=(4, 1)) == [
        "mqa", "heads"]
    words = feature_words("heads", ODD_HEADS, heads_q=4, heads_kv=1, lengths=(4, 4, 4))
    assert words == "heads 4/1 not divisible by W=3"
    assert feature_words("heads", ODD_HEADS, heads_q=4, heads_kv=1, world_size=3) == words


def test_the_new_fields_are_in_the_dict_form():
    d = Capabilities().to_dict()
    assert d["zigzag_odd"] is True and d["heads_divisible_by_world"] is False and d["tiles"] == [64, 128]
    d = ODD_HEADS.to_dict()
    assert d["zigzag_odd"] is False and d["heads_divisible_by_world"] is True


def test_adapters_declare_even_zigzag_chunks_and_ulysses_heads():
    for name in ("torch-ring", "torch-ring-alltoall", "torch-cp", "torch-cp-alltoall", "ring-flash-attn-zigzag",
                 "yunchang-ring"):
        assert not caps_of(name).zigzag_odd, name
    assert caps_of("yunchang-ulysses").heads_divisible_by_world
    ulysses = {"yunchang-ulysses", "deepspeed-ulysses", "deepspeed-ulysses-seqfirst", "deepspeed-alst",
               "deepspeed-fpdt"}
    for name in registry.builtin_names():
        assert caps_of(name).heads_divisible_by_world == (name in ulysses), name  # USP: its own rule
    # DeepSpeed's uneven-heads path and unequal lengths are let through: the probe shows what it does
    # (tests/impls/test_deepspeed.py)
    assert all(v.lets_run == {"heads", "uneven"} for v in deepspeed.VARIANTS.values())
    assert caps_of("reference").zigzag_odd and caps_of("flash-ring").zigzag_odd
    # the libraries that run odd zigzag lengths (right or wrong) get to run them: the probe shows what they do;
    # torch-cp would shard them contiguously (no load balancing), so it refuses them
    lets_run = {name: v.lets_run for mod in (ring_flash_attn, yunchang, torch_ring, torch_cp)
                for name, v in mod.VARIANTS.items() if v.lets_run}
    assert lets_run == {name: {"zigzag-odd"} for name in ("ring-flash-attn-zigzag", "yunchang-ring", "torch-ring",
                                                          "torch-ring-alltoall")}


def test_run_side_refusals_of_odd_zigzag_and_heads():
    ctx = make_ctx(layout="zigzag", lengths=(3, 3))
    q = torch.zeros(1, 3, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ImplError, match=r"^torch-cp: unsupported here: zigzag with an odd local length \[3, 3\]$"):
        _common.require_supported("torch-cp", RunContext(**{**ctx.__dict__, "device": torch.device("cuda")}),
                                  caps_of("torch-cp"), q, q)
    zz = ring_flash_attn.VARIANTS["ring-flash-attn-zigzag"]
    _common.require_supported("ring-flash-attn-zigzag", ctx, zz.capabilities, q, q, zz.lets_run)  # let through
    assert _common.unsupported_reasons(ctx, zz.capabilities, q, q) == ["zigzag with an odd local length [3, 3]"]
    with pytest.raises(ImplError, match=r"^ring-flash-attn-zigzag: unsupported here: dtype fp32$"):  # only that
        _common.require_supported("ring-flash-attn-zigzag", ctx, zz.capabilities, q.float(), q.float(), zz.lets_run)
    ctx3 = make_ctx(lengths=(8, 8, 8))
    q3, k3 = torch.zeros(1, 8, 4, 16, dtype=torch.bfloat16), torch.zeros(1, 8, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ImplError, match=r"^yunchang-ulysses: unsupported here: heads 4/1 not divisible by W=3$"):
        _common.require_supported("yunchang-ulysses", ctx3, caps_of("yunchang-ulysses"), q3, k3)


def _case(**kw):
    from harness.case import make_case

    base = dict(world_size=4, seq_lens=(3, 3, 3, 3), layout="zigzag", mask=MaskSpec("causal"), heads_q=4,
                heads_kv=2, head_dim=16, seed=7)
    return make_case(**{**base, **kw})


@pytest.mark.parametrize("caps, fields, lens", [
    (ODD, {}, (4, 4, 4, 4)),  # an even split: the total rounded up to a multiple of 2W
    (ODD, dict(world_size=1, seq_lens=(3,)), (4,)),  # W=1
    (ODD, dict(world_size=1, seq_lens=(1,)), (2,)),
    (ODD, dict(seq_lens=(5, 1, 17, 3)), (6, 2, 18, 4)),  # uneven declared: each length rounded up
    (ODD, dict(world_size=3, seq_lens=(7, 6, 6)), (8, 6, 6)),  # an odd total
    (Capabilities(zigzag_odd=False, uneven=False), dict(world_size=3, seq_lens=(7, 6, 6)), (8, 8, 8)),
    (Capabilities(zigzag_odd=False, uneven=False), dict(seq_lens=(7, 7, 7, 6)), (8, 8, 8, 8)),
    # a smaller world keeps the total (9 -> 5 + 4), then the odd length is rounded up
    (Capabilities(zigzag_odd=False, world_sizes=(1, 2)), dict(world_size=3, seq_lens=(3, 3, 3)), (6, 4)),
    (Capabilities(zigzag_odd=False, world_sizes=(1, 2), uneven=False), dict(world_size=3, seq_lens=(3, 3, 3)),
     (6, 6)),
    (Capabilities(zigzag_odd=False, layouts=frozenset({"zigzag"})), dict(layout="contiguous"), (4, 4, 4, 4)),
    (ODD, dict(layout="contiguous"), (3, 3, 3, 3)),  # odd lengths are fine outside zigzag
])
def test_adapt_makes_zigzag_local_lengths_even(caps, fields, lens):
    from harness.impls.capabilities import adapt, unsupported

    c = _case(**fields)
    a = adapt(caps, c)
    assert a is not None and not unsupported(caps, a)
    assert tuple(a.seq_lens) == lens
    assert (a.heads_q, a.heads_kv, a.head_dim, a.seed, a.mask) == (c.heads_q, c.heads_kv, c.head_dim, c.seed, c.mask)
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
    a = adapt(caps, _case(world_size=3, seq_lens=(3, 3, 3), mask=MaskSpec("document", doc_starts=(0, 4, 8))))
    assert a.seq_lens == (6, 6) and a.mask.doc_starts == (0, 4, 8) and not unsupported(caps, a)


@pytest.mark.parametrize("caps, fields, heads", [
    (ODD_HEADS, dict(world_size=3, seq_lens=(4, 4, 4), heads_q=4, heads_kv=1), (6, 3)),  # MQA -> GQA, still grouped
    (ODD_HEADS, dict(world_size=3, seq_lens=(4, 4, 4), heads_q=4, heads_kv=2), (6, 3)),
    (ODD_HEADS, dict(seq_lens=(4,) * 4, heads_q=2, heads_kv=1), (8, 4)),  # at least 2 query heads per kv head
    (ODD_HEADS, dict(seq_lens=(4,) * 4, heads_q=6, heads_kv=3), (8, 4)),
    (ODD_HEADS, dict(seq_lens=(4,) * 4, heads_q=2, heads_kv=2), (4, 4)),  # MHA stays MHA
    (ODD_HEADS, dict(seq_lens=(4,) * 8, world_size=8, heads_q=6, heads_kv=1), (16, 8)),
    (Capabilities(heads_divisible_by_world=True, gqa=False), dict(world_size=3, seq_lens=(4, 4, 4)), (6, 6)),
    (Capabilities(heads_divisible_by_world=True, world_sizes=(1, 2)), dict(world_size=3, seq_lens=(4, 4, 4),
                                                                          heads_q=3, heads_kv=1), (4, 2)),
    (ODD_HEADS, dict(world_size=1, seq_lens=(4,), heads_q=5, heads_kv=1), (5, 1)),  # W=1: unchanged
])
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

    caps_list = [ODD_HEADS, Capabilities(zigzag_odd=False, uneven=False, heads_divisible_by_world=True, gqa=False),
                 Capabilities(zigzag_odd=False, layouts=frozenset({"zigzag"}), world_sizes=(2, 4), uneven=False)]

    @settings(max_examples=150, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategies.cases())
    def check(c):
        for caps in caps_list:
            a = adapt(caps, c)
            assert a is not None and not unsupported(caps, a), (caps, c.summary())
            if a.mask.kind == "document":
                assert a.mask.doc_starts[0] == 0 and max(a.mask.doc_starts) < a.total_len

    check()


def test_kernel_tiles_take_any_integers_and_refuse_the_rest_in_one_line():
    from harness.errors import ImplError

    assert Capabilities(tiles=[128, 64, 64]).tiles == (64, 128) and Capabilities(tiles=96).tiles == (96,)
    for bad in ((), ("64",), (0,), (True,), "64", 1.5):
        with pytest.raises(ImplError, match=r"^Capabilities.tiles: expected integers 1..65536, tile sizes") as e:
            Capabilities(tiles=bad)
        assert "\n" not in str(e.value)
