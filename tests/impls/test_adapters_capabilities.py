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
    ring_attention_pytorch,
    serving,
    te_cp,
    torch_cp,
    torch_ring,
    yunchang,
)
from harness.impls.registry import ImplError
from ring_impl.layouts import LAYOUTS
from ring_impl.masks import MASK_FEATURES, MaskSpec
from tests.helpers.contexts import caps_of, make_ctx


@pytest.mark.parametrize("name", registry.builtin_names())
def test_declarations_are_well_formed(name):
    c = caps_of(name)
    assert c.layouts and c.layouts <= set(LAYOUTS)
    assert c.masks and c.masks <= set(MASK_FEATURES)
    assert c.dtypes and c.dtypes <= set(DTYPES)
    assert c.devices and c.devices <= {"cpu", "cuda"}
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
    assert c.devices == ({"cpu"} if on_standin else {"cuda"})
    if not name.startswith("torch-cp"):
        assert c.dtypes == {"fp16", "bf16"} and c.head_dims is not None and 64 in c.head_dims


def test_specific_claims():
    ref = caps_of("reference")
    assert ref.returns_lse and ref == Capabilities(
        returns_lse=True,
        masks=frozenset(MASK_FEATURES),
        idle_ranks=True,
        sinks=True,
        softcap=True,
        alibi=True,
        head_dim_v=True,
    )
    rap = caps_of("ring-attention-pytorch")
    assert rap.dtypes == {"fp32"} and not rap.uneven and rap.world_sizes[0] == 2
    assert rap.layouts == {"contiguous", "striped"} and rap.masks == {"none", "causal"}
    tr = caps_of("torch-ring")
    assert tr.devices == {"cpu"} and tr.returns_lse and tr.layouts == {"contiguous", "zigzag"}
    assert caps_of("torch-ring-alltoall") == tr
    assert caps_of("ring-flash-attn-zigzag").masks == {"causal"}
    assert caps_of("ring-flash-attn-stripe").masks == {"causal"}
    assert caps_of("ring-flash-attn").masks == {"none", "causal"}
    assert caps_of("ring-flash-attn-llama3").masks == {
        "none",
        "causal",
        "window",
        "document",
        "expr",
        "and",
        "full",
        # no window-right (two-sided)
        "per-document",
    }
    assert caps_of("yunchang-ulysses").masks == {
        "none",
        "causal",
        "window",
        "expr",
        "and",
        "full",
        "window-right",
    }
    assert "window" not in caps_of("te-cp-p2p").masks
    assert "window" in caps_of("te-cp-a2a").masks and "window" in caps_of("te-cp-all-gather").masks
    assert (
        "window-right" in caps_of("te-cp-a2a").masks
        and "document" not in caps_of("te-cp-all-gather").masks
    )
    assert all(caps_of(n).layouts == {"zigzag"} for n in te_cp.VARIANTS if not n.endswith("-thd"))
    # it reshards to TE's THD partition itself
    assert caps_of("te-cp-p2p-thd").layouts == set(LAYOUTS)
    assert (
        caps_of("yunchang-usp").layouts == {"contiguous"}
        and caps_of("yunchang-usp").world_sizes[0] == 4
    )
    assert not any(
        caps_of(n).uneven
        for n in registry.builtin_names()
        if n not in ("reference", "flash-ring", *serving.VARIANTS)
    )


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
    assert (
        _common.unsupported_reasons(
            make_ctx(), caps, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)
        )
        == []
    )


def test_require_supported_backend_and_world():
    caps = caps_of("torch-cp")
    why = _common.unsupported_reasons(
        make_ctx(lengths=(8,) * 9), caps, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)
    )
    assert any(w.startswith("device cpu") for w in why)
    assert any(w.startswith("world size 9") for w in why)
    assert any(w.startswith("dtype fp32") for w in why)


def test_gqa_refused_only_where_undeclared():
    q, k = torch.zeros(1, 8, 4, 16), torch.zeros(1, 8, 2, 16)
    assert any(
        "GQA" in w for w in _common.unsupported_reasons(make_ctx(), caps_of("torch-cp"), q, k)
    )
    assert not any(
        "GQA" in w for w in _common.unsupported_reasons(make_ctx(), caps_of("torch-ring"), q, k)
    )


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
    assert (
        args["causal"] is False and args["striped_ring_attn"] is False and args["bucket_size"] == 8
    )
    assert ring_attention_pytorch.q_prescale(64**-0.5, 64) == pytest.approx(1.0)
    assert ring_attention_pytorch.q_prescale(0.1, 16) == pytest.approx(0.4)


def test_gqa_head_permutation_round_trip_and_convention():
    q = torch.randn(2, 3, 6, 4)
    assert torch.equal(_common.tiled_to_grouped(_common.grouped_to_tiled(q, 2), 2), q)
    assert torch.equal(_common.grouped_to_tiled(q, 6), q)  # no GQA: untouched
    for heads, kv in ((6, 2), (8, 2), (8, 4), (4, 1)):
        g = heads // kv
        src = (
            _common.grouped_to_tiled(torch.arange(heads).float().view(1, 1, heads, 1), kv)
            .view(-1)
            .long()
        )
        # tiled slot j uses kv head j % kv; it holds grouped head src[j], whose kv head is src[j] //
        # G
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
    assert doc.cu_seqlens(16).dtype == torch.int32 and FlashMask().cu_seqlens(16).tolist() == [
        0,
        16,
    ]


def _flash_visible(fm, total: int) -> torch.Tensor:
    """What flash-attn varlen computes for `fm` over a whole stream (every document's queries and
    keys, Lq = Lk per document): the stand-in's copy of flash-attn 2.8.3's window arithmetic,
    document by document."""
    import importlib.util

    from harness.kernels import flash_standin

    path = flash_standin.STANDIN_DIR / "flash_attn" / "_cpu_core.py"
    spec = importlib.util.spec_from_file_location("_rh_cpu_core", path)
    # torch only: loaded alone, no flash_attn package installed
    core = importlib.util.module_from_spec(spec)
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
    """Every mask drawn from what `flash_mask` claims (conjunctions of full, causal, two-sided
    windows, documents, per-document) maps, and flash-attn's visibility of the mapping is the mask,
    position by position; what flash-attn cannot express maps to None."""
    from harness.impls.adapters._common import FLASH_MASK_FEATURES, flash_mask
    from harness.search.strategies import masks
    from ring_impl.mask_eval import allowed

    total = data.draw(st.integers(1, 40))
    spec = data.draw(
        masks(total, tuple(sorted(FLASH_MASK_FEATURES)), boundaries=(0, total // 3, total // 2))
    )
    fm = flash_mask(spec, total)
    assert fm is not None, spec.describe()
    pos = torch.arange(total)
    want = allowed(spec, pos, pos)
    want = torch.ones(total, total, dtype=torch.bool) if want is None else want
    assert torch.equal(_flash_visible(fm, total), want), (spec.describe(), fm)


def test_flash_mask_refuses_what_flash_attn_cannot_express():
    from harness.impls.adapters._common import flash_mask
    from ring_impl.masks import and_, not_, or_, prim

    for expr in (
        or_(prim("causal"), prim("prefix", 3)),
        not_(prim("causal")),
        prim("chunked", 4),
        and_(prim("causal"), prim("inverse-causal")),
        prim("dilated", 4, 2, 0),
    ):
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
        "attn_mask_type": "no_mask",
        "window_size": (3, 2),
    }
    assert te_cp.mask_args(
        make_ctx(mask=MaskSpec.of(and_(prim("window", 3, 2), prim("causal"))))
    ) == {"attn_mask_type": "causal", "window_size": (3, 0)}
    assert te_cp.mask_args(
        make_ctx(mask=MaskSpec("document", doc_starts=(0, 4), causal=False)), thd=True
    ) == {"attn_mask_type": "padding", "window_size": (-1, -1)}
    assert (
        te_cp.mask_args(make_ctx(mask=MaskSpec("causal")), thd=True)["attn_mask_type"]
        == "padding_causal"
    )
    with pytest.raises(ImplError, match="not divisible by 2\\*W"):
        te_cp.check_shapes("te-cp-p2p", make_ctx(lengths=(5, 5)), 4, 4)
    with pytest.raises(ImplError, match="a2a needs head counts divisible"):
        te_cp.check_shapes("te-cp-a2a", make_ctx(lengths=(4, 4, 4)), 4, 4)
    te_cp.check_shapes("te-cp-p2p", make_ctx(lengths=(4, 4, 4)), 4, 4)


def _te_visible(args: dict, total: int) -> torch.Tensor:
    """TE's visibility for self-attention (equal lengths: its bottom-right diagonal is ours): causal
    cuts j > i; window_size (left, right) keeps i - left <= j <= i + right, -1 unlimited."""
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
    """Every mask drawn from what te-cp-a2a / -all-gather declare (none, causal, one- and two-sided
    windows, their conjunctions) maps to TE arguments whose visibility is the mask, position by
    position."""
    from harness.search.strategies import masks
    from ring_impl.mask_eval import allowed

    total = data.draw(st.integers(1, 40))
    spec = data.draw(
        masks(total, tuple(sorted(caps_of("te-cp-a2a").masks)), boundaries=(0, total // 2))
    )
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
    assert why == [
        "ring in a subgroup (global ranks [1, 2]): runs only on the whole default process group"
    ]
    assert _common.unsupported_reasons(ctx, caps_of("torch-ring"), q, q) == []
