"""The one capability rule: feature keys and their words on the case and the run side, odd zigzag
lengths and head counts the world size divides. `adapt` has its own file: test_capability_adapt.py."""

from __future__ import annotations

import pytest
import torch

from harness.context import Capabilities, RunContext
from harness.impls import registry
from harness.impls.adapters import (
    _common,
    deepspeed,
    ring_flash_attn,
    torch_cp,
    torch_ring,
    yunchang,
)
from harness.impls.registry import ImplError
from ring_impl.masks import MaskSpec
from tests.helpers.contexts import caps_of, make_ctx

CASE_VS_RUN = [
    # (implementation, case fields) -> the same feature keys on the case side and inside the run
    (
        "ring-attention-pytorch",
        dict(
            layout="zigzag",
            seq_lens=(9, 7),
            mask=MaskSpec("window", window=2),
            dtype="bf16",
            heads_q=4,
            heads_kv=2,
        ),
    ),
    ("ring-flash-attn", dict(seq_lens=(8,) * 9, heads_q=4, heads_kv=1, head_dim=13)),
    ("torch-cp", dict(seq_lens=(8, 8), heads_q=4, heads_kv=1)),
    ("ring-attention-pytorch", dict(seq_lens=(8, 8), group_offset=1)),
    ("reference", dict(seq_lens=(5, 1), layout="striped", dtype="fp16", heads_q=6, heads_kv=3)),
    ("torch-ring", dict(layout="zigzag", seq_lens=(3, 3), mask=MaskSpec("causal"))),
    (
        "ring-flash-attn-zigzag",
        dict(layout="zigzag", seq_lens=(5, 5, 5), dtype="bf16", head_dim=16),
    ),
    (
        "yunchang-ulysses",
        dict(seq_lens=(8, 8, 8), dtype="bf16", heads_q=4, heads_kv=1, head_dim=16),
    ),
]


@pytest.mark.parametrize("name,fields", CASE_VS_RUN)
def test_one_rule_for_cases_and_runs(name, fields):
    """`capabilities.unsupported` (case) and `require_supported` (run) are one rule: the same keys,
    apart from the tensors' device, which only the run side knows."""
    from harness.case import make_case
    from harness.dtypes import TORCH_DTYPES
    from harness.impls.capabilities import missing_features, unsupported

    caps = caps_of(name)
    c = make_case(impl=name, world_size=len(fields["seq_lens"]), **fields)
    case_keys = unsupported(caps, c)
    ctx = RunContext(
        **{
            **make_ctx(layout=c.layout, lengths=c.seq_lens, mask=c.mask).__dict__,
            "global_ranks": tuple(range(c.group_offset, c.group_offset + c.world_size)),
        }
    )
    q = torch.zeros(1, c.seq_lens[0], c.heads_q, c.head_dim, dtype=TORCH_DTYPES[c.dtype])
    k = torch.zeros(1, c.seq_lens[0], c.heads_kv, c.head_dim, dtype=TORCH_DTYPES[c.dtype])
    run_keys = missing_features(
        caps,
        layout=ctx.layout,
        mask_kind=ctx.mask.kind,
        dtype=c.dtype,
        world_size=ctx.world_size,
        heads_q=c.heads_q,
        heads_kv=c.heads_kv,
        lengths=ctx.lengths,
        head_dim=c.head_dim,
        subgroup=_common.is_subgroup(ctx),
        device=_common.device_of(ctx),
    )
    assert [f for f in run_keys if not f.startswith("device:")] == case_keys
    assert unsupported(caps, c, device="cpu") == run_keys
    assert len(_common.unsupported_reasons(ctx, caps, q, k)) == len(run_keys)
    if name == "reference":
        assert case_keys == run_keys == []


def test_feature_keys_and_words():
    from harness.impls.capabilities import feature_words, missing_features

    caps = Capabilities(
        layouts=frozenset({"contiguous"}),
        masks=frozenset({"causal"}),
        dtypes=frozenset({"bf16"}),
        gqa=False,
        uneven=False,
        devices=frozenset({"cuda"}),
        head_dims=(64,),
        subgroups=False,
    )
    keys = missing_features(
        caps,
        layout="zigzag",
        mask_kind="window",
        dtype="fp32",
        world_size=9,
        heads_q=4,
        heads_kv=1,
        lengths=(5, 1),
        head_dim=13,
        subgroup=None,
        device=None,
    )
    assert keys == [
        "layout:zigzag",
        "mask:window",
        "dtype:fp32",
        "world:9",
        "mqa",
        "uneven",
        "head_dim:13",
    ]
    assert "gqa" in missing_features(
        caps,
        layout="contiguous",
        mask_kind="causal",
        dtype="bf16",
        world_size=2,
        heads_q=4,
        heads_kv=2,
        lengths=(8, 8),
        head_dim=64,
        subgroup=None,
        device=None,
    )
    words = [feature_words(f, caps, heads_q=4, heads_kv=1, lengths=(5, 1)) for f in keys]
    assert words == [
        "layout zigzag",
        "mask window",
        "dtype fp32",
        "world size 9 (supports 1..8)",
        "GQA (4 query heads, 1 kv heads)",
        "uneven split [5, 1]",
        "head_dim 13",
    ]
    assert missing_features(
        caps,
        layout="contiguous",
        mask_kind="causal",
        dtype="bf16",
        world_size=2,
        heads_q=2,
        heads_kv=2,
        lengths=(8, 8),
        head_dim=64,
        subgroup=True,
        device="cpu",
    ) == ["subgroup", "device:cpu"]
    assert feature_words("device:cpu", caps) == "device cpu (supports cuda)"


# -- zigzag with an odd local length, head counts the world size divides (issues #10, #11)
# ----------------

ODD_HEADS = Capabilities(zigzag_odd=False, heads_divisible_by_world=True)
ODD = Capabilities(zigzag_odd=False)


def _missing(caps, layout="zigzag", lengths=(4, 4), heads=(4, 4), **kw):
    from harness.impls.capabilities import missing_features

    args = dict(
        layout=layout,
        mask_kind="causal",
        dtype="fp32",
        world_size=len(lengths),
        heads_q=heads[0],
        heads_kv=heads[1],
        lengths=lengths,
        head_dim=16,
        subgroup=None,
        device=None,
    )
    return missing_features(caps, **{**args, **kw})


def test_zigzag_odd_key_and_words():
    from harness.impls.capabilities import feature_words

    assert _missing(ODD_HEADS, lengths=(3, 3)) == ["zigzag-odd"]
    # torch's IndexError case
    assert _missing(ODD_HEADS, lengths=(1,) * 8, heads=(8, 8)) == ["zigzag-odd"]
    # W=1: two chunks of one rank too
    assert _missing(ODD_HEADS, lengths=(3,), heads=(1, 1)) == ["zigzag-odd"]
    assert _missing(ODD_HEADS, lengths=(4, 2)) == []  # uneven is declared here, both lengths even
    assert _missing(ODD_HEADS, lengths=(4, 3)) == ["zigzag-odd"]
    assert _missing(ODD_HEADS, layout="contiguous", lengths=(3, 3)) == []
    assert _missing(ODD_HEADS, layout="striped", lengths=(3, 3)) == []
    assert _missing(Capabilities(), lengths=(3, 3)) == []  # declared by default
    assert _missing(Capabilities(zigzag_odd=False, uneven=False), lengths=(4, 3)) == [
        "uneven",
        "zigzag-odd",
    ]
    assert (
        feature_words("zigzag-odd", ODD_HEADS, lengths=(3, 3))
        == "zigzag with an odd local length [3, 3]"
    )


def test_heads_key_and_words():
    from harness.impls.capabilities import feature_words

    assert _missing(ODD_HEADS, lengths=(4, 4, 4), heads=(4, 1)) == ["heads"]
    assert _missing(ODD_HEADS, lengths=(4, 4, 4), heads=(6, 2)) == ["heads"]  # kv heads too
    assert _missing(ODD_HEADS, lengths=(4, 4, 4), heads=(6, 3)) == []
    assert _missing(ODD_HEADS, lengths=(4,), heads=(5, 1)) == []  # W=1 divides everything
    # not required by default
    assert _missing(Capabilities(), lengths=(4, 4, 4), heads=(4, 1)) == []
    assert _missing(
        Capabilities(gqa=False, heads_divisible_by_world=True), lengths=(4, 4, 4), heads=(4, 1)
    ) == ["mqa", "heads"]
    words = feature_words("heads", ODD_HEADS, heads_q=4, heads_kv=1, lengths=(4, 4, 4))
    assert words == "heads 4/1 not divisible by W=3"
    assert feature_words("heads", ODD_HEADS, heads_q=4, heads_kv=1, world_size=3) == words


def test_the_new_fields_are_in_the_dict_form():
    d = Capabilities().to_dict()
    assert (
        d["zigzag_odd"] is True
        and d["heads_divisible_by_world"] is False
        and d["tiles"] == [64, 128]
    )
    d = ODD_HEADS.to_dict()
    assert d["zigzag_odd"] is False and d["heads_divisible_by_world"] is True


def test_the_old_backends_keyword_reads_as_devices():
    """`backends=` (gloo, nccl) was the name of `devices` (cpu, cuda): an adapter passing it keeps
    working."""
    import dataclasses

    from harness.errors import ImplError

    assert Capabilities(backends={"gloo"}).devices == {"cpu"}
    assert Capabilities(backends=["gloo", "nccl"]) == Capabilities()
    assert dataclasses.replace(Capabilities(devices={"cuda"}), backends={"gloo"}).devices == {"cpu"}
    assert dataclasses.replace(Capabilities(devices={"cuda"}), gqa=False).devices == {"cuda"}
    d = Capabilities().to_dict()
    assert "backends" not in d and d["devices"] == ["cpu", "cuda"]
    old = r"^Capabilities.backends: unknown backend 'mpi'; expected some of gloo, nccl$"
    with pytest.raises(ImplError, match=old):
        Capabilities(backends={"mpi"})
    new = r"^Capabilities.devices: unknown device 'gloo'; expected some of cpu, cuda$"
    with pytest.raises(ImplError, match=new):
        Capabilities(devices={"gloo"})


def test_adapters_declare_even_zigzag_chunks_and_ulysses_heads():
    for name in (
        "torch-ring",
        "torch-ring-alltoall",
        "torch-cp",
        "torch-cp-alltoall",
        "ring-flash-attn-zigzag",
        "yunchang-ring",
    ):
        assert not caps_of(name).zigzag_odd, name
    assert caps_of("yunchang-ulysses").heads_divisible_by_world
    ulysses = {
        "yunchang-ulysses",
        "deepspeed-ulysses",
        "deepspeed-ulysses-seqfirst",
        "deepspeed-alst",
        "deepspeed-fpdt",
    }
    for name in registry.builtin_names():
        # USP: its own rule
        assert caps_of(name).heads_divisible_by_world == (name in ulysses), name
    # DeepSpeed's uneven-heads path and unequal lengths are let through: the probe shows what it
    # does (tests/impls/test_deepspeed.py)
    assert all(v.lets_run == {"heads", "uneven"} for v in deepspeed.VARIANTS.values())
    assert caps_of("reference").zigzag_odd and caps_of("flash-ring").zigzag_odd
    # the libraries that run odd zigzag lengths (right or wrong) get to run them: the probe shows
    # what they do; torch-cp would shard them contiguously (no load balancing), so it refuses them
    lets_run = {
        name: v.lets_run
        for mod in (ring_flash_attn, yunchang, torch_ring, torch_cp)
        for name, v in mod.VARIANTS.items()
        if v.lets_run
    }
    assert lets_run == {
        name: {"zigzag-odd"}
        for name in ("ring-flash-attn-zigzag", "yunchang-ring", "torch-ring", "torch-ring-alltoall")
    }


def test_run_side_refusals_of_odd_zigzag_and_heads():
    ctx = make_ctx(layout="zigzag", lengths=(3, 3))
    q = torch.zeros(1, 3, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(
        ImplError,
        match=r"^torch-cp: unsupported here: zigzag with an odd local "
        r"length \[3, 3\]$",
    ):
        _common.require_supported(
            "torch-cp",
            RunContext(**{**ctx.__dict__, "device": torch.device("cuda")}),
            caps_of("torch-cp"),
            q,
            q,
        )
    zz = ring_flash_attn.VARIANTS["ring-flash-attn-zigzag"]
    # let through
    _common.require_supported("ring-flash-attn-zigzag", ctx, zz.capabilities, q, q, zz.lets_run)
    assert _common.unsupported_reasons(ctx, zz.capabilities, q, q) == [
        "zigzag with an odd local length [3, 3]"
    ]
    # only that
    with pytest.raises(ImplError, match=r"^ring-flash-attn-zigzag: unsupported here: dtype fp32$"):
        _common.require_supported(
            "ring-flash-attn-zigzag", ctx, zz.capabilities, q.float(), q.float(), zz.lets_run
        )
    ctx3 = make_ctx(lengths=(8, 8, 8))
    q3, k3 = (
        torch.zeros(1, 8, 4, 16, dtype=torch.bfloat16),
        torch.zeros(1, 8, 1, 16, dtype=torch.bfloat16),
    )
    with pytest.raises(
        ImplError,
        match=r"^yunchang-ulysses: unsupported here: heads 4/1 not "
        r"divisible by W=3$",
    ):
        _common.require_supported("yunchang-ulysses", ctx3, caps_of("yunchang-ulysses"), q3, k3)


def test_kernel_tiles_take_any_integers_and_refuse_the_rest_in_one_line():
    from harness.errors import ImplError

    assert Capabilities(tiles=[128, 64, 64]).tiles == (64, 128) and Capabilities(
        tiles=96
    ).tiles == (96,)
    for bad in ((), ("64",), (0,), (True,), "64", 1.5):
        with pytest.raises(
            ImplError,
            match=r"^Capabilities.tiles: expected integers 1..65536, "
            r"tile sizes",
        ) as e:
            Capabilities(tiles=bad)
        assert "\n" not in str(e.value)
