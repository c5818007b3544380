"""Adapters run in this process (a one-rank gloo group, or no group at all) against the float64
oracle.

These check the adapters' conventions (tensor layouts, softmax scale, GQA head order, lse) with the
real libraries, without a rank pool; multi-rank behaviour is in test_adapters_e2e.py.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from harness.context import RunContext
from harness.impls import registry
from harness.impls.adapters import torch_ring
from harness.oracle import assemble
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """A one-rank gloo default group for this module (left alone if a group already exists)."""
    mine = not dist.is_initialized()
    if mine:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "fs"), 1)
        dist.init_process_group(
            "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
        )
    yield dist.group.WORLD
    if mine:
        dist.destroy_process_group()


def ctx1(group, n, mask, scale, layout="contiguous", dtype=torch.float32):
    return RunContext(
        group=group,
        rank=0,
        world_size=1,
        global_ranks=(0,),
        layout=layout,
        lengths=(n,),
        all_positions=tuple(all_positions(layout, [n])),
        mask=mask,
        softmax_scale=scale,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def inputs(n=12, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, n, hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(2, n, hkv, d, generator=g) for _ in range(2))
    return [t.to(dtype) for t in (q, k, v, dout)]


def run_and_grad(impl, ctx, q, k, v, dout):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    res = impl.run(q, k, v, ctx)
    out, lse = res if isinstance(res, tuple) else (res, None)
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("name", ["torch-ring", "torch-ring-alltoall"])
@pytest.mark.parametrize("mask", [MaskSpec(), MaskSpec("causal")])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
def test_torch_ring_one_rank_matches_oracle(world1, name, mask, hq, hkv):
    impl = registry.resolve(name)
    q, k, v, dout = inputs(hq=hq, hkv=hkv)
    out, lse, dq, dk, dv = run_and_grad(impl, ctx1(world1, 12, mask, 0.3), q, k, v, dout)
    exact = assemble.attention(q, k, v, dout, mask, 0.3, torch.float64)
    assert lse.dtype == torch.float32 and lse.shape == (2, hq, 12)
    for got, want in (
        (out, exact.out),
        (lse, exact.lse),
        (dq, exact.dq),
        (dk, exact.dk),
        (dv, exact.dv),
    ):
        assert max_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_ring_half_dtypes(world1, dtype):
    """Every tensor within ONE unit of the input dtype at the tensor's scale (eps * max|exact|), lse
    within 2^-19 relative (torch's CPU kernel computes exp to ~20 bits; see
    harness/judging/tolerance.py). Measured on torch 2.13.0 (this test's inputs): out/dq/dk/dv
    0.21-0.59 units, lse 1.9e-7 absolute (~2^-22 of |lse|): the bound is ~1.7x the worst measured
    error, so an implementation that rounds an intermediate (e.g. dq through bf16 for fp16 inputs, 8
    fp16 units) fails it."""
    impl = registry.resolve("torch-ring")
    q, k, v, dout = inputs(dtype=dtype)
    out, lse, dq, dk, dv = run_and_grad(
        impl, ctx1(world1, 12, MaskSpec("causal"), 0.25, dtype=dtype), q, k, v, dout
    )
    exact = assemble.attention(q, k, v, dout, MaskSpec("causal"), 0.25, torch.float64)
    assert out.dtype == dtype and dq.dtype == dtype and lse.dtype == torch.float32
    eps = torch.finfo(dtype).eps
    for name, got, want in (
        ("out", out, exact.out),
        ("dq", dq, exact.dq),
        ("dk", dk, exact.dk),
        ("dv", dv, exact.dv),
    ):
        assert max_err(got, want) <= eps * want.abs().max().item(), name
    assert max_err(lse, exact.lse) <= 2.0**-19 * exact.lse.abs().max().item()


def test_the_half_dtype_bound_catches_one_extra_rounding(world1):
    """The bound above is not vacuous: dq rounded through bf16 for fp16 inputs (ring-flash-attn's
    `dq.to(torch.bfloat16)`) exceeds it."""
    impl = registry.resolve("torch-ring")
    q, k, v, dout = inputs(dtype=torch.float16)
    _, _, dq, _, _ = run_and_grad(
        impl, ctx1(world1, 12, MaskSpec("causal"), 0.25, dtype=torch.float16), q, k, v, dout
    )
    exact = assemble.attention(q, k, v, dout, MaskSpec("causal"), 0.25, torch.float64)
    bad = dq.to(torch.bfloat16).to(torch.float16)
    assert max_err(bad, exact.dq) > torch.finfo(torch.float16).eps * exact.dq.abs().max().item()


@pytest.mark.parametrize(
    "name,method", [("torch-ring", "ALL_GATHER"), ("torch-ring-alltoall", "ALL_TO_ALL")]
)
def test_torch_ring_uses_its_rotate_method_and_restores_options(world1, monkeypatch, name, method):
    mod = torch_ring.load_private_api()
    seen = []
    real = mod._create_rotater

    def spy(pg, seq_dim, method=None):
        seen.append(method or mod._cp_options.rotate_method)
        return real(pg, seq_dim, method)

    monkeypatch.setattr(mod, "_create_rotater", spy)
    before = (mod._cp_options.rotate_method, mod._cp_options.enable_load_balance)
    impl = registry.resolve(name)
    q, k, v, dout = inputs()
    run_and_grad(impl, ctx1(world1, 12, MaskSpec("causal"), 0.25, layout="zigzag"), q, k, v, dout)
    # forward K/V and backward K/V rotate with the chosen method; torch's backward rotates dK/dV
    # with all-to-all whatever the option says (so no assumption on the order rotaters are created
    # in)
    want, a2a = getattr(mod._RotateMethod, method), mod._RotateMethod.ALL_TO_ALL
    assert seen.count(want) >= 2 and all(m in (want, a2a) for m in seen), seen
    assert (mod._cp_options.rotate_method, mod._cp_options.enable_load_balance) == before


@pytest.mark.extra
def test_ring_attention_pytorch_conventions_one_process():
    """The library without a ring (ring_reduce_col=False, no process group): our q prescale and GQA
    head permutation make it compute our attention, forward and backward."""
    lib = pytest.importorskip("ring_attention_pytorch")
    from harness.impls.adapters import _common
    from harness.impls.adapters import ring_attention_pytorch as adapter

    q, k, v, dout = inputs(n=10, hq=6, hkv=2, d=8)
    scale = 0.41
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    qs = _common.grouped_to_tiled(qq * adapter.q_prescale(scale, 8), 2)
    out = _common.tiled_to_grouped(lib.ring_flash_attn(qs, kk, vv, causal=True, bucket_size=10), 2)
    out.backward(dout)
    exact = assemble.attention(q, k, v, dout, MaskSpec("causal"), scale, torch.float64)
    for got, want in (
        (out, exact.out),
        (qq.grad, exact.dq),
        (kk.grad, exact.dk),
        (vv.grad, exact.dv),
    ):
        assert max_err(got, want) < 1e-5
