"""The CPU stand-in for flash-attn 2.8.3's Python API (harness/kernels/standin/flash_attn) against
float64.

The float64 reference and the derived bounds live in tests/helpers/flash_float64.py.
`test_bounds_reject_wrong_variants` shows that wrong kernels (GQA heads mapped i % Hkv, a key block
missing, top-left causal alignment, lse off by 1e-3 in the forward, a backward given an lse off by
1e-2) fail these bounds, and `test_backward_uses_the_given_lse_and_out` that a block's own out or
lse instead of the merged ones does. Rounding P / dS before the matmuls and per-head dK before the
GQA sum only cost accuracy, so constructed cases with cancellation pin them
(`test_rounding_points_*`: the unrounded variants miss by more than 10 ulps).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.flash_float64 import (
    HALF,
    U,
    backward,
    fa,
    fai,
    forward,
    fwd_bounds,
    grad_bounds,
    heads,
    inputs,
    ref_mask,
    reference,
    within,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- forward / backward against
# float64

CASES = {  # (b, sq, sk, h, hk, d, causal, window)
    "mha": (2, 64, 64, 2, 2, 64, False, (-1, -1)),
    "mha-causal": (1, 64, 64, 3, 3, 32, True, (-1, -1)),
    "gqa-causal-sq<sk": (2, 40, 100, 4, 2, 32, True, (-1, -1)),
    "mqa-causal-sq>sk-empty-rows": (1, 100, 40, 4, 1, 16, True, (-1, -1)),
    "gqa-window": (1, 70, 70, 4, 2, 8, False, (8, 4)),
    "window-left-only-sq<sk": (1, 50, 80, 2, 2, 40, False, (16, -1)),
    "window-right-only-sq>sk-empty-rows": (1, 80, 50, 2, 1, 24, False, (-1, 3)),
    "causal-window-two-key-blocks": (1, 130, 150, 2, 2, 24, True, (5, -1)),
    "window-two-key-blocks-sq>sk": (1, 160, 140, 2, 2, 16, False, (20, 7)),
    "head-dim-256-gqa": (1, 20, 24, 4, 2, 256, True, (-1, -1)),
    "head-dim-8-two-key-blocks": (1, 33, 200, 1, 1, 8, False, (-1, -1)),
}


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_forward_backward_vs_float64(case, dtype):
    b, sq, sk, h, hk, d, causal, window = case
    q, k, v, dout = inputs(dtype, b, sq, sk, h, hk, d)
    scale = d**-0.5
    out, lse, s_dmask, rng_state = forward(q, k, v, causal, window)
    assert (
        out.shape == q.shape
        and out.dtype == dtype
        and lse.shape == (b, h, sq)
        and lse.dtype == torch.float32
    )
    assert s_dmask.numel() == 0 and rng_state.shape == (2,) and rng_state.dtype == torch.int64
    mask = ref_mask(sq, sk, causal, window)
    out64, lse64, p, dq64, dk64, dv64 = reference(q, k, v, dout, mask, scale)
    tol_out, tol_lse, a_max = fwd_bounds(q, k, v, mask, scale, lse64)
    empty = ~mask.any(-1)
    assert within(out, out64, tol_out)
    assert within(lse[..., ~empty], lse64[..., ~empty], tol_lse)
    assert (out[:, empty] == 0).all() and (lse[..., empty] == math.inf).all()
    dq, dk, dv, softmax_d = backward(dout, q, k, v, out, lse, causal, window)
    b_dq, b_dk, b_dv = grad_bounds(q, k, v, dout, out, lse, out64, lse64, p, scale, a_max)
    assert within(dq, dq64, b_dq) and within(dk, dk64, b_dk) and within(dv, dv64, b_dv)
    assert (dq[:, empty] == 0).all()
    assert all(bool(torch.isfinite(x).all()) for x in (out, dq, dk, dv))
    assert (
        softmax_d.shape == (b, h, fai.round_multiple(sq, 128)) and softmax_d.dtype == torch.float32
    )
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[..., :sq], delta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [8, 24, 40, 64, 96, 128, 160, 192, 256])
def test_head_dims(d):
    q, k, v, dout = inputs(torch.bfloat16, 1, 12, 16, 2, 1, d, seed=d)
    out, lse, _, _ = forward(q, k, v, causal=True)
    mask = ref_mask(12, 16, causal=True)
    out64, lse64, p, dq64, dk64, dv64 = reference(q, k, v, dout, mask, d**-0.5)
    tol_out, tol_lse, a_max = fwd_bounds(q, k, v, mask, d**-0.5, lse64)
    assert within(out, out64, tol_out) and within(lse, lse64, tol_lse)
    dq, dk, dv, _ = backward(dout, q, k, v, out, lse, causal=True)
    bounds = grad_bounds(q, k, v, dout, out, lse, out64, lse64, p, d**-0.5, a_max)
    assert all(
        within(x, r, bd) for x, r, bd in zip((dq, dk, dv), (dq64, dk64, dv64), bounds, strict=True)
    )


def test_bounds_reject_wrong_variants():
    """The bounds above are tight enough to catch real kernel bugs (each variant computed
    exactly)."""
    q, k, v, dout = inputs(torch.float16, 1, 40, 200, 4, 2, 32, seed=3)
    scale, mask = 32**-0.5, ref_mask(40, 200, causal=True)
    out, lse, _, _ = forward(q, k, v, causal=True)
    out64, lse64, p, dq64, dk64, dv64 = reference(q, k, v, dout, mask, scale)
    tol_out, tol_lse, a_max = fwd_bounds(q, k, v, mask, scale, lse64)
    assert within(out, out64, tol_out) and within(lse, lse64, tol_lse)
    modulo = reference(q, k, v, dout, mask, scale, modulo=True)  # GQA heads mapped i % Hkv
    assert not within(modulo[0], out64, tol_out)
    missing = mask.clone()
    missing[:, 128:] = False  # the second key block dropped
    assert not within(reference(q, k, v, dout, missing, scale)[0], out64, tol_out)
    top_left = torch.ones(40, 200, dtype=torch.bool).tril()  # j <= i: causal aligned top-left
    assert not within(reference(q, k, v, dout, top_left, scale)[0], out64, tol_out)
    assert not within(lse64 + 1e-3, lse64, tol_lse)
    bounds = grad_bounds(q, k, v, dout, out, lse, out64, lse64, p, scale, a_max)
    assert not within(modulo[3], dq64, bounds[0]) and not within(modulo[4], dk64, bounds[1])
    # an lse off by 1e-2: P off by 1%
    dq_off = backward(dout, q, k, v, out, lse + 1e-2, causal=True)[0]
    assert within(backward(dout, q, k, v, out, lse, causal=True)[0], dq64, bounds[0])
    assert not within(dq_off, dq64, bounds[0])


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_rounding_points_forward_p(dtype):
    """Two keys, S = (0, -c), v = (+1, -1): out = (1 - P~2) / (1 + P2) cancels, so rounding P2 to
    the dtype before P @ V moves out by many ulps of out; the unrounded variant is far outside one
    ulp."""
    # P2 = exp(-c) a quarter ulp off the grid
    c = 1.75 * (2.0**-11 if dtype == torch.float16 else 2.0**-9)
    q = torch.zeros(1, 1, 1, 8, dtype=dtype)
    k = torch.zeros(1, 2, 1, 8, dtype=dtype)
    v = torch.zeros(1, 2, 1, 8, dtype=dtype)
    q[0, 0, 0, 0], k[0, 1, 0, 0], v[0, 0, 0, 1], v[0, 1, 0, 1] = 1.0, -c, 1.0, -1.0
    out = forward(q, k, v, scale=1.0)[0][0, 0, 0, 1].double()
    p2 = math.exp(-c)
    rounded = (
        torch.tensor((1 - torch.tensor(p2).to(dtype).double().item()) / (1 + p2)).to(dtype).double()
    )
    unrounded = torch.tensor((1 - p2) / (1 + p2)).to(dtype).double()
    ulp = U[dtype] * 2 * abs(rounded)
    assert abs(out - rounded) <= ulp and abs(unrounded - rounded) > 10 * ulp


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_rounding_points_backward(dtype):
    """dQ: keys sharing component 1 give dQ_1 = dS~_1 + dS~_2 with dS_1 ~ -dS_2 (rows of dS sum to
    ~0), so rounding dS before dS @ K decides dQ_1. dV: two queries with dO = (+1, -1) give dV_j =
    P~_1j - P~_2j."""
    c = 1.75 * (2.0**-11 if dtype == torch.float16 else 2.0**-9)
    q = torch.zeros(1, 2, 1, 8, dtype=dtype)
    k = torch.zeros(1, 2, 1, 8, dtype=dtype)
    v = torch.zeros(1, 2, 1, 8, dtype=dtype)
    dout = torch.zeros(1, 2, 1, 8, dtype=dtype)
    q[0, 0, 0, 0], q[0, 1, 0, 0] = 1.0, 3.0
    k[0, 1, 0, 0], k[0, :, 0, 1] = -c, 1.0
    v[0, 0, 0, 2], v[0, 1, 0, 2] = 1.0, -1.0
    dout[0, 0, 0, 2], dout[0, 1, 0, 2] = 1.0, -1.0
    out, lse, _, _ = forward(q, k, v, scale=1.0)
    dq, _, dv, _ = backward(dout, q, k, v, out, lse, scale=1.0)

    def rnd(x):
        return x.to(dtype).double()

    s = torch.einsum("qd,kd->qk", q[0, :, 0].double(), k[0, :, 0].double())
    p = torch.exp(s - lse[0, 0].double().unsqueeze(-1))
    dp = torch.einsum("qd,kd->qk", dout[0, :, 0].double(), v[0, :, 0].double())
    ds = p * (dp - (dout[0, :, 0].double() * out[0, :, 0].double()).sum(-1, keepdim=True))
    for got, rounded, unrounded in (
        (dq[0, 0, 0, 1], rnd(ds[0]).sum(), ds[0].sum()),
        (dv[0, 1, 0, 2], rnd(p[0, 1]) - rnd(p[1, 1]), p[0, 1] - p[1, 1]),
    ):
        expected, variant = rnd(rounded), rnd(unrounded)
        tol = U[dtype] * 2 * abs(expected) + 2.0**-24
        assert abs(got.double() - expected) <= tol and abs(variant - expected) > 10 * tol


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_rounding_points_gqa_group_sum(dtype):
    """GQA: flash_api.cpp rounds each query head's dK to the dtype (dk_expanded) before summing the
    group. Two query heads with dO_2 = -(1 - 2^-6) dO_1 give per-head dK that nearly cancel in the
    sum."""
    c, scale = 1.75 * (2.0**-11 if dtype == torch.float16 else 2.0**-9), 0.3
    q = torch.zeros(1, 1, 2, 8, dtype=dtype)
    k = torch.zeros(1, 2, 1, 8, dtype=dtype)
    v = torch.zeros(1, 2, 1, 8, dtype=dtype)
    dout = torch.zeros(1, 1, 2, 8, dtype=dtype)
    q[0, 0, :, 0], k[0, 1, 0, 0], k[0, :, 0, 1] = 1.0, -c / scale, 1.0
    v[0, 0, 0, 2], v[0, 1, 0, 2] = 1.0, -1.0
    dout[0, 0, 0, 2], dout[0, 0, 1, 2] = 1.0, -(1 - 2.0**-6)
    out, lse, _, _ = forward(q, k, v, scale=scale)
    dk = backward(dout, q, k, v, out, lse, scale=scale)[1][0, 0, 0, 0].double()

    def rnd(x):
        return x.to(dtype).double()

    s = scale * torch.einsum("hd,kd->hk", q[0, 0].double(), k[0, :, 0].double())
    p = torch.exp(s - lse[0, :, 0].double().unsqueeze(-1))
    dp = torch.einsum("hd,kd->hk", dout[0, 0].double(), v[0, :, 0].double())
    ds = rnd(p * (dp - (dout[0, 0].double() * out[0, 0].double()).sum(-1, keepdim=True)))
    per_head = scale * ds[:, 0]  # dK of key 0, component 0, for each query head (q = e_0)
    expected, variant = rnd(rnd(per_head).sum()), rnd(per_head.sum())
    tol = U[dtype] * 2 * abs(expected) + 2.0**-24
    assert abs(dk - expected) <= tol and abs(variant - expected) > 10 * tol


def test_one_sided_window_mirrors_the_kernel_not_the_docstring():
    """flash-attn 2.8.3 turns window (left >= 0, right = -1) into right = seqlen_k
    (set_params_fprop), not an unlimited right side: with seqlen_q > seqlen_k + 1 the first rows see
    fewer keys than the docstring says. sq = 6, sk = 2, window (1, -1): keys j with i - 5 <= j <= i
    - 2, i.e. rows 0-1 none, row 2 key 0 only."""
    q, k, v, dout = inputs(torch.float16, 1, 6, 2, 1, 1, 8)
    out, lse, _, _ = forward(q, k, v, window=(1, -1))
    kernel = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [1, 1]], dtype=torch.bool)
    # the docstring's reading differs
    assert not torch.equal(kernel, ref_mask(6, 2, window=(1, -1)))
    out64, lse64, *_ = reference(q, k, v, dout, kernel, 8**-0.5)
    tol_out, tol_lse, _ = fwd_bounds(q, k, v, kernel, 8**-0.5, lse64)
    assert (
        within(out, out64, tol_out)
        and (out[0, :2] == 0).all()
        and (lse[0, 0, :2] == math.inf).all()
    )
    assert within(lse[..., 2:], lse64[..., 2:], tol_lse)


def test_no_keys_at_all():
    q, k, v, dout = inputs(torch.bfloat16, 2, 5, 0, 2, 1, 16)
    out, lse, _, _ = forward(q, k, v)
    assert (out == 0).all() and (lse == math.inf).all()
    dq, dk, dv, _ = backward(dout, q, k, v, out, lse)
    assert (dq == 0).all() and dk.numel() == 0


def test_backward_writes_into_strided_views():
    """ring libraries pass slices of bigger buffers (zigzag: dq_buffer[:, :seqlen_q]; llama3: dq[:,
    q_slice])."""
    q, k, v, dout = inputs(torch.float16, 2, 24, 40, 4, 2, 16, seed=5)
    out, lse, _, _ = forward(q, k, v, causal=True)
    expected = backward(dout, q, k, v, out, lse, causal=True)[:3]
    big = torch.full((2, 48, 4, 16), 7.0, dtype=torch.float16)
    kv = torch.full((2, 2, 40, 2, 16), 7.0, dtype=torch.float16)
    views = (big[:, ::2], kv[0], kv[1])
    assert not views[0].is_contiguous()
    backward(dout, q, k, v, out, lse, causal=True, bufs=views)
    assert all(torch.equal(view, e) for view, e in zip(views, expected, strict=True))
    assert (big[:, 1::2] == 7).all()
    heads_big = torch.full((2, 24, 8, 16), 7.0, dtype=torch.float16)
    backward(dout, q, k, v, out, lse, causal=True, bufs=(heads_big[:, :, 2:6], *expected[1:]))
    assert torch.equal(heads_big[:, :, 2:6], expected[0]) and (heads_big[:, :, :2] == 7).all()


def _varlen(q, k, v, dout, cu_q, cu_k, causal, window=(-1, -1)):
    mq, mk = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    scale = q.shape[-1] ** -0.5
    out, lse, _, _ = fai._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, mq, mk, 0.0, scale, causal, *window
    )
    dq = torch.full((q.shape[0], q.shape[1] * 2, q.shape[2]), 7.0, dtype=q.dtype)[:, ::2]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    softmax_d = fai._flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        cu_q,
        cu_k,
        mq,
        mk,
        0.0,
        scale,
        causal,
        *window,
        0.0,
        None,
        False,
    )
    return out, lse, dq, dk, dv, softmax_d


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (6, 2))])
def test_varlen_matches_per_document_calls(causal, window):
    """Documents with seqlen_q < = > seqlen_k; causal/window bottom-right aligned per document."""
    lens_q, lens_k = [7, 20, 13], [19, 20, 5]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, dout = (
        x[0] for x in inputs(torch.bfloat16, 1, sum(lens_q), sum(lens_k), 4, 2, 16, seed=9)
    )
    k, v = k[: sum(lens_k)], v[: sum(lens_k)]
    out, lse, dq, dk, dv, softmax_d = _varlen(q, k, v, dout, cu_q, cu_k, causal, window)
    assert lse.shape == (4, sum(lens_q)) and lse.dtype == torch.float32
    assert softmax_d.shape == (4, sum(lens_q) + 128 * 3)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [x[s].unsqueeze(0) for x, s in ((q, qs), (k, ks), (v, ks), (dout, qs))]
        o, lse_b, _, _ = forward(*one[:3], causal, window)
        grads = backward(one[3], *one[:3], o, lse_b, causal, window)
        assert torch.equal(out[qs], o[0]) and torch.equal(lse[:, qs], lse_b[0])
        assert torch.equal(dq[qs], grads[0][0])
        assert torch.equal(dk[ks], grads[1][0]) and torch.equal(dv[ks], grads[2][0])
        start = int(cu_q[b]) + 128 * b
        torch.testing.assert_close(
            softmax_d[:, start : start + lens_q[b]], grads[3][0, :, : lens_q[b]]
        )
        mask = ref_mask(lens_q[b], lens_k[b], causal, window)
        out64, lse64, *_ = reference(*one, mask, 16**-0.5)
        assert within(out[qs], out64[0], fwd_bounds(*one[:3], mask, 16**-0.5, lse64)[0])


def test_backward_uses_the_given_lse_and_out():
    """A ring step: keys split in two blocks, each block's backward given the merged (global) out
    and lse. The blocks' gradients add up to the global ones, and block 1's dq follows the float64
    formula dQ = scale sum_j P_ij (dP_ij - D_i) k_j with P = exp(S - lse_global), D = rowsum(dO *
    out_global)."""
    q, k, v, dout = inputs(torch.float16, 1, 32, 64, 2, 2, 16, seed=11)
    scale, mask = 0.25, ref_mask(32, 64, causal=True)
    out, lse, _, _ = forward(q, k, v, causal=True)
    out64, lse64, p, dq64, dk64, dv64 = reference(q, k, v, dout, mask, scale)
    tol_out, tol_lse, a_max = fwd_bounds(q, k, v, mask, scale, lse64)
    b_dq, b_dk, b_dv = grad_bounds(q, k, v, dout, out, lse, out64, lse64, p, scale, a_max)
    halves = (slice(0, 32), slice(32, 64))
    parts = [backward(dout, q, k[:, h], v[:, h], out, lse, causal=(h.start == 32)) for h in halves]
    dq = parts[0][0].double() + parts[1][0].double()
    assert within(dq, dq64, 2 * b_dq)  # two dq roundings instead of one
    assert within(torch.cat([parts[0][1], parts[1][1]], 1), dk64, b_dk)
    assert within(torch.cat([parts[0][2], parts[1][2]], 1), dv64, b_dv)
    qh, kh, vh, doh = heads(q, 2), heads(k[:, :32], 2), heads(v[:, :32], 2), heads(dout, 2)
    p1 = torch.exp(torch.einsum("bhqd,bhkd->bhqk", qh, kh) * scale - lse.double().unsqueeze(-1))
    delta = (doh * heads(out, 2)).sum(-1, keepdim=True)
    ds1 = p1 * (torch.einsum("bhqd,bhkd->bhqk", doh, vh) - delta)
    formula = (torch.einsum("bhqk,bhkd->bhqd", ds1, kh) * scale).permute(0, 2, 1, 3)
    assert within(parts[0][0], formula, b_dq)
    # block 1's own out / lse, not the merged
    local_out, local_lse, _, _ = forward(q, k[:, :32], v[:, :32])
    assert not within(backward(dout, q, k[:, :32], v[:, :32], out, local_lse)[0], formula, b_dq)
    assert not within(backward(dout, q, k[:, :32], v[:, :32], local_out, lse)[0], formula, b_dq)


def test_flash_attn_func_autograd_vs_float64():
    # head dim 12: padded to 16
    q, k, v, dout = inputs(torch.bfloat16, 2, 30, 50, 4, 2, 12, seed=13)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, s_dmask = fa.flash_attn_func(
        *leaves, causal=True, window_size=(10, -1), return_attn_probs=True
    )
    out.backward(dout)
    mask = ref_mask(30, 50, causal=True, window=(10, -1))
    out64, lse64, p, dq64, dk64, dv64 = reference(q, k, v, dout, mask, 12**-0.5)
    tol_out, tol_lse, a_max = fwd_bounds(q, k, v, mask, 12**-0.5, lse64)
    assert (
        out.shape == q.shape
        and within(out.detach(), out64, tol_out)
        and within(lse, lse64, tol_lse)
    )
    bounds = grad_bounds(q, k, v, dout, out.detach(), lse, out64, lse64, p, 12**-0.5, a_max)
    assert all(
        within(x.grad, r, bd) for x, r, bd in zip(leaves, (dq64, dk64, dv64), bounds, strict=True)
    )
    with torch.no_grad():
        assert torch.equal(
            fa.flash_attn_func(q, k, v, causal=True, window_size=(10, -1)), out.detach()
        )
