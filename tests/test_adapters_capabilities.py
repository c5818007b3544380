"""Declared capabilities, mask/argument mappings, and refusals outside the declaration."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.context import DTYPES, Capabilities, RunContext
from harness.impls import registry
from harness.impls.adapters import (
    _common,
    ring_attention_pytorch,
    ring_flash_attn,
    te_cp,
    torch_cp,
    torch_ring,
    yunchang,
)
from harness.impls.registry import ImplError
from ring_impl.layouts import LAYOUTS, all_positions
from ring_impl.masks import MASK_KINDS, MaskSpec


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
    module = importlib.import_module(registry.BUILTINS[name].partition(":")[0])
    return module.CAPABILITIES[name]


@pytest.mark.parametrize("name", registry.builtin_names())
def test_declarations_are_well_formed(name):
    c = caps_of(name)
    assert c.layouts and c.layouts <= set(LAYOUTS)
    assert c.masks and c.masks <= set(MASK_KINDS)
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
    c = caps_of(name)
    assert c.backends == {"nccl"}
    if not name.startswith("torch-cp"):
        assert c.dtypes == {"fp16", "bf16"} and c.head_dims is not None and 64 in c.head_dims


def test_specific_claims():
    assert caps_of("reference").returns_lse and caps_of("reference") == Capabilities(returns_lse=True)
    rap = caps_of("ring-attention-pytorch")
    assert rap.dtypes == {"fp32"} and not rap.uneven and rap.world_sizes[0] == 2
    assert rap.layouts == {"contiguous", "striped"} and rap.masks == {"none", "causal"}
    tr = caps_of("torch-ring")
    assert tr.backends == {"gloo"} and tr.returns_lse and tr.layouts == {"contiguous", "zigzag"}
    assert caps_of("torch-ring-alltoall") == tr
    assert caps_of("ring-flash-attn-zigzag").masks == {"causal"}
    assert caps_of("ring-flash-attn-stripe").masks == {"causal"}
    assert caps_of("ring-flash-attn").masks == {"none", "causal"}
    assert caps_of("ring-flash-attn-llama3").masks == {"none", "causal", "window", "document"}
    assert "window" not in caps_of("te-cp-p2p").masks
    assert "window" in caps_of("te-cp-a2a").masks and "window" in caps_of("te-cp-all-gather").masks
    assert all(caps_of(n).layouts == {"zigzag"} for n in te_cp.COMM)
    assert caps_of("yunchang-usp").layouts == {"contiguous"} and caps_of("yunchang-usp").world_sizes[0] == 4
    assert not any(caps_of(n).uneven for n in registry.builtin_names() if n != "reference")


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
    assert _common.unsupported(make_ctx(), caps, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)) == []


def test_require_supported_backend_and_world():
    caps = caps_of("ring-flash-attn")
    why = _common.unsupported(
        make_ctx(lengths=(8,) * 9), caps, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)
    )
    assert any(w.startswith("backend gloo") for w in why)
    assert any(w.startswith("world size 9") for w in why)
    assert any(w.startswith("dtype fp32") for w in why)


def test_gqa_refused_only_where_undeclared():
    q, k = torch.zeros(1, 8, 4, 16), torch.zeros(1, 8, 2, 16)
    assert any("GQA" in w for w in _common.unsupported(make_ctx(), caps_of("torch-cp"), q, k))
    assert not any("GQA" in w for w in _common.unsupported(make_ctx(), caps_of("torch-ring"), q, k))


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


def test_ring_flash_attn_mask_arguments():
    assert ring_flash_attn.window_size(make_ctx(mask=MaskSpec("window", window=5))) == (5, 0)
    assert ring_flash_attn.window_size(make_ctx(mask=MaskSpec("causal"))) == (-1, -1)
    doc = MaskSpec("document", doc_starts=(0, 3, 10), causal=False)
    assert ring_flash_attn.cu_seqlens(make_ctx(mask=doc)).tolist() == [0, 3, 10, 16]
    assert ring_flash_attn.cu_seqlens(make_ctx(mask=doc)).dtype == torch.int32
    assert ring_flash_attn.cu_seqlens(make_ctx(mask=MaskSpec())).tolist() == [0, 16]
    assert not ring_flash_attn.is_causal(make_ctx(mask=doc))
    assert ring_flash_attn.is_causal(make_ctx(mask=MaskSpec("window", window=1)))


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
    with pytest.raises(ImplError, match="not divisible by 2\\*W"):
        te_cp.check_shapes("te-cp-p2p", make_ctx(lengths=(5, 5)), 4, 4)
    with pytest.raises(ImplError, match="a2a needs head counts divisible"):
        te_cp.check_shapes("te-cp-a2a", make_ctx(lengths=(4, 4, 4)), 4, 4)
    te_cp.check_shapes("te-cp-p2p", make_ctx(lengths=(4, 4, 4)), 4, 4)


def test_yunchang_ring_types_cover_declared_layouts():
    assert set(yunchang.RING_TYPE) == caps_of("yunchang-ring").layouts
