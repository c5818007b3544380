"""The CPU stand-in for flash-attn 2.8.3's Python API (harness/kernels/standin/flash_attn) against float64.

The reference is written here (einsum over a brute-force boolean mask from a double loop; nothing from the
harness). The stand-in is loaded under a private module name, so this process never gets a `flash_attn`
module; install() is tested in subprocesses, the ring libraries with the stand-in installed and removed
again around each test.

Tolerances are derived, not guessed. u = unit roundoff of the input dtype (2^-11 fp16, 2^-8 bf16),
u32 = 2^-24; the reference runs on the same rounded inputs, so input rounding costs nothing.
forward   |out - out64| <= 1.1 (2u + fp16_sub + 2 d u32 A + 2 (sk + 4) u32) max|v|: u for rounding P to the
          dtype before P @ V (|sum_j (P~_j - P_j) v_j| / l <= u max|v|), u for the final cast, the rest fp32
          (A = max scale sum_c |q_c k_c| bounds the dot-product error of S, d u32 A; fp16_sub = sk 2^-25 for
          P in fp16's subnormal range). |lse - lse64| <= 2 (d u32 A + (sk + 4) u32 + u32 max|lse|).
backward  elementwise first-order bounds (`grad_bounds`) built from float64 P, dP, D, dS and the errors of
          the out and lse the backward is given (it recomputes P from that lse and D from that out):
          eps_P = |lse - lse64| + 2 d u32 A + 4 u32 (relative error of the fp32 P), |D err| =
          |dO . (out - out64)| + d u32 sum|dO out|; dS rounded to the dtype (u |dS|) plus those errors;
          dQ = scale dS K, dK = scale dS^T Q (fp32 sums: sk u32, sq u32), dV = P~^T dO (u for P~); each cast
          to the dtype (u |.|), dK/dV once more per query head before the GQA group sum; times 1.1.
`test_bounds_reject_wrong_variants` shows that wrong kernels (GQA heads mapped i % Hkv, a key block missing,
top-left causal alignment, lse off by 1e-3 in the forward, a backward given an lse off by 1e-2) fail these
bounds, and `test_backward_uses_the_given_lse_and_out` that a block's own out or lse instead of the merged
ones does. Rounding P / dS before the matmuls and per-head dK before the GQA sum only cost accuracy, so
constructed cases with cancellation pin them (`test_rounding_points_*`: the unrounded variants miss by more
than 10 ulps).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness.kernels import flash_standin

ROOT = Path(__file__).resolve().parents[2]
U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
U32 = 2.0**-24
HALF = [torch.float16, torch.bfloat16]


def _load_private():
    name = "_rh_flash_standin_under_test"
    if name not in sys.modules:
        folder = flash_standin.STANDIN_DIR / "flash_attn"
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name], importlib.import_module(name + ".flash_attn_interface")


fa, fai = _load_private()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- float64 reference and bounds


def ref_mask(sq: int, sk: int, causal: bool = False, window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """flash_attn_func's docstring: query i sees keys i + sk - sq - left ..= i + sk - sq + right, -1 = no limit."""
    left, right = window
    right = 0 if causal else right
    rows = []
    for i in range(sq):
        diag = i + sk - sq
        rows.append([(left < 0 or j >= diag - left) and (right < 0 or j <= diag + right) for j in range(sk)])
    return torch.tensor(rows, dtype=torch.bool).reshape(sq, sk)


def heads(x: torch.Tensor, n: int, modulo: bool = False) -> torch.Tensor:
    """(b, s, hk, d) -> (b, n, s, d) float64: query head i reads kv head i // (n // hk) (or i % hk)."""
    hk = x.shape[2]
    idx = torch.arange(n) % hk if modulo else torch.arange(n) // (n // hk)
    return x.double()[:, :, idx].permute(0, 2, 1, 3)


def reference(q, k, v, dout, mask, scale, modulo=False):
    """float64 out (b, sq, h, d), lse (b, h, sq) (-inf: no key), P (b, h, sq, sk) and autograd dq, dk, dv."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    hq = q.shape[2]
    s = torch.einsum("bhqd,bhkd->bhqk", heads(q64, hq), heads(k64, hq, modulo)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    out = torch.einsum("bhqk,bhkd->bqhd", p, heads(v64, hq, modulo))
    lse = (torch.where(torch.isfinite(m), m, torch.zeros_like(m)) + torch.log(total)).squeeze(-1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), p.detach(), q64.grad, k64.grad, v64.grad


def fwd_bounds(q, k, v, mask, scale, lse64):
    """(tol_out, tol_lse, A): the derived max-norm bounds of the module docstring."""
    u, d, sk = U[q.dtype], q.shape[-1], k.shape[1]
    a = torch.einsum("bhqd,bhkd->bhqk", heads(q, q.shape[2]).abs(), heads(k, q.shape[2]).abs()) * scale
    a_max = float(a.masked_fill(~mask, 0).max()) if mask.any() else 0.0
    sub = sk * 2.0**-25 if q.dtype == torch.float16 else 0.0
    tol_out = 1.1 * (2 * u + sub + 2 * d * U32 * a_max + 2 * (sk + 4) * U32) * float(v.double().abs().max())
    finite = lse64[torch.isfinite(lse64)]
    lse_max = float(finite.abs().max()) if finite.numel() else 0.0
    tol_lse = 2 * (d * U32 * a_max + (sk + 4) * U32 + U32 * lse_max)
    return tol_out, tol_lse, a_max


def grad_bounds(q, k, v, dout, out, lse, out64, lse64, p, scale, a_max):
    """Elementwise first-order bounds on |dq - dq64|, |dk - dk64|, |dv - dv64| (layouts as q, k, v) for a
    backward given the stand-in's `out` and `lse`: their actual errors enter through D and P."""
    u, d = U[q.dtype], q.shape[-1]
    (b, sq, hq, _), (sk, hk) = q.shape, k.shape[1:3]
    sub = 2.0**-25 if q.dtype == torch.float16 else 0.0  # fp16 subnormal spacing: absolute rounding error
    qh, kh, vh, doh, oh = heads(q, hq), heads(k, hq), heads(v, hq), heads(dout, hq), out64.permute(0, 2, 1, 3)
    err_lse = torch.where(torch.isfinite(lse64), (lse.double() - lse64).abs(), torch.zeros_like(lse64))
    eps_p = err_lse.unsqueeze(-1) + 2 * d * U32 * a_max + 4 * U32  # relative error of the stand-in's fp32 P
    dp = torch.einsum("bhqd,bhkd->bhqk", doh, vh)
    delta = (doh * oh).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    err_out = heads(out, hq) - oh
    err_delta = (doh * err_out).sum(-1, keepdim=True).abs() + d * U32 * (doh * heads(out, hq)).abs().sum(-1, True)
    f = torch.einsum("bhqd,bhkd->bhqk", doh.abs(), vh.abs())
    err_ds = ds.abs() * (eps_p + u) + p * (d * U32 * f + err_delta) + sub
    dq_h = torch.einsum("bhqk,bhkd->bhqd", ds, kh) * scale
    dk_h = torch.einsum("bhqk,bhqd->bhkd", ds, qh) * scale
    dv_h = torch.einsum("bhqk,bhqd->bhkd", p, doh)
    b_dq = scale * torch.einsum("bhqk,bhkd->bhqd", err_ds + sk * U32 * ds.abs(), kh.abs()) + u * dq_h.abs()
    b_dk = scale * torch.einsum("bhqk,bhqd->bhkd", err_ds + sq * U32 * ds.abs(), qh.abs()) + 2 * u * dk_h.abs()
    b_dv = torch.einsum("bhqk,bhqd->bhkd", (u + eps_p + sq * U32) * p + sub, doh.abs()) + 2 * u * dv_h.abs()

    def per_kv_head(x):  # (b, hq, sk, d) -> (b, sk, hk, d), summed over each group
        return x.reshape(b, hk, hq // hk, sk, d).sum(2).permute(0, 2, 1, 3)

    return 1.1 * b_dq.permute(0, 2, 1, 3), 1.1 * per_kv_head(b_dk), 1.1 * per_kv_head(b_dv)


def within(x: torch.Tensor, ref: torch.Tensor, bound) -> bool:
    return bool(((x.double() - ref).abs() <= bound).all())


def inputs(dtype, b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in
            ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))]


def forward(q, k, v, causal=False, window=(-1, -1), scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fai._flash_attn_forward(q, k, v, 0.0, scale, causal, window[0], window[1], 0.0, None, False)


def backward(dout, q, k, v, out, lse, causal=False, window=(-1, -1), scale=None, bufs=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = bufs or (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal,
                                         window[0], window[1], 0.0, None, False)
    return dq, dk, dv, softmax_d


# ---------------------------------------------------------------- forward / backward against float64

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
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, sq) and lse.dtype == torch.float32
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
    assert softmax_d.shape == (b, h, fai.round_multiple(sq, 128)) and softmax_d.dtype == torch.float32
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
    assert all(within(x, r, bd) for x, r, bd in zip((dq, dk, dv), (dq64, dk64, dv64), bounds, strict=True))


def test_bounds_reject_wrong_variants():
    """The bounds above are tight enough to catch real kernel bugs (each variant computed exactly)."""
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
    dq_off = backward(dout, q, k, v, out, lse + 1e-2, causal=True)[0]  # an lse off by 1e-2: P off by 1%
    assert within(backward(dout, q, k, v, out, lse, causal=True)[0], dq64, bounds[0])
    assert not within(dq_off, dq64, bounds[0])


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_rounding_points_forward_p(dtype):
    """Two keys, S = (0, -c), v = (+1, -1): out = (1 - P~2) / (1 + P2) cancels, so rounding P2 to the dtype
    before P @ V moves out by many ulps of out; the unrounded variant is far outside one ulp."""
    c = 1.75 * (2.0**-11 if dtype == torch.float16 else 2.0**-9)  # P2 = exp(-c) a quarter ulp off the grid
    q = torch.zeros(1, 1, 1, 8, dtype=dtype)
    k = torch.zeros(1, 2, 1, 8, dtype=dtype)
    v = torch.zeros(1, 2, 1, 8, dtype=dtype)
    q[0, 0, 0, 0], k[0, 1, 0, 0], v[0, 0, 0, 1], v[0, 1, 0, 1] = 1.0, -c, 1.0, -1.0
    out = forward(q, k, v, scale=1.0)[0][0, 0, 0, 1].double()
    p2 = math.exp(-c)
    rounded = torch.tensor((1 - torch.tensor(p2).to(dtype).double().item()) / (1 + p2)).to(dtype).double()
    unrounded = torch.tensor((1 - p2) / (1 + p2)).to(dtype).double()
    ulp = U[dtype] * 2 * abs(rounded)
    assert abs(out - rounded) <= ulp and abs(unrounded - rounded) > 10 * ulp


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_rounding_points_backward(dtype):
    """dQ: keys sharing component 1 give dQ_1 = dS~_1 + dS~_2 with dS_1 ~ -dS_2 (rows of dS sum to ~0), so
    rounding dS before dS @ K decides dQ_1. dV: two queries with dO = (+1, -1) give dV_j = P~_1j - P~_2j."""
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
    for got, rounded, unrounded in ((dq[0, 0, 0, 1], rnd(ds[0]).sum(), ds[0].sum()),
                                    (dv[0, 1, 0, 2], rnd(p[0, 1]) - rnd(p[1, 1]), p[0, 1] - p[1, 1])):
        expected, variant = rnd(rounded), rnd(unrounded)
        tol = U[dtype] * 2 * abs(expected) + 2.0**-24
        assert abs(got.double() - expected) <= tol and abs(variant - expected) > 10 * tol


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_rounding_points_gqa_group_sum(dtype):
    """GQA: flash_api.cpp rounds each query head's dK to the dtype (dk_expanded) before summing the group.
    Two query heads with dO_2 = -(1 - 2^-6) dO_1 give per-head dK that nearly cancel in the sum."""
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
    """flash-attn 2.8.3 turns window (left >= 0, right = -1) into right = seqlen_k (set_params_fprop), not an
    unlimited right side: with seqlen_q > seqlen_k + 1 the first rows see fewer keys than the docstring says.
    sq = 6, sk = 2, window (1, -1): keys j with i - 5 <= j <= i - 2, i.e. rows 0-1 none, row 2 key 0 only."""
    q, k, v, dout = inputs(torch.float16, 1, 6, 2, 1, 1, 8)
    out, lse, _, _ = forward(q, k, v, window=(1, -1))
    kernel = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [1, 1]], dtype=torch.bool)
    assert not torch.equal(kernel, ref_mask(6, 2, window=(1, -1)))  # the docstring's reading differs
    out64, lse64, *_ = reference(q, k, v, dout, kernel, 8**-0.5)
    tol_out, tol_lse, _ = fwd_bounds(q, k, v, kernel, 8**-0.5, lse64)
    assert within(out, out64, tol_out) and (out[0, :2] == 0).all() and (lse[0, 0, :2] == math.inf).all()
    assert within(lse[..., 2:], lse64[..., 2:], tol_lse)


def test_no_keys_at_all():
    q, k, v, dout = inputs(torch.bfloat16, 2, 5, 0, 2, 1, 16)
    out, lse, _, _ = forward(q, k, v)
    assert (out == 0).all() and (lse == math.inf).all()
    dq, dk, dv, _ = backward(dout, q, k, v, out, lse)
    assert (dq == 0).all() and dk.numel() == 0


def test_backward_writes_into_strided_views():
    """ring libraries pass slices of bigger buffers (zigzag: dq_buffer[:, :seqlen_q]; llama3: dq[:, q_slice])."""
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
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, scale, causal, *window)
    dq = torch.full((q.shape[0], q.shape[1] * 2, q.shape[2]), 7.0, dtype=q.dtype)[:, ::2]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    softmax_d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, mq, mk, 0.0,
                                                scale, causal, *window, 0.0, None, False)
    return out, lse, dq, dk, dv, softmax_d


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (6, 2))])
def test_varlen_matches_per_document_calls(causal, window):
    """Documents with seqlen_q < = > seqlen_k; causal/window bottom-right aligned per document."""
    lens_q, lens_k = [7, 20, 13], [19, 20, 5]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, dout = (x[0] for x in inputs(torch.bfloat16, 1, sum(lens_q), sum(lens_k), 4, 2, 16, seed=9))
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
        torch.testing.assert_close(softmax_d[:, start : start + lens_q[b]], grads[3][0, :, : lens_q[b]])
        mask = ref_mask(lens_q[b], lens_k[b], causal, window)
        out64, lse64, *_ = reference(*one, mask, 16**-0.5)
        assert within(out[qs], out64[0], fwd_bounds(*one[:3], mask, 16**-0.5, lse64)[0])


def test_backward_uses_the_given_lse_and_out():
    """A ring step: keys split in two blocks, each block's backward given the merged (global) out and lse.
    The blocks' gradients add up to the global ones, and block 1's dq follows the float64 formula
    dQ = scale sum_j P_ij (dP_ij - D_i) k_j with P = exp(S - lse_global), D = rowsum(dO * out_global)."""
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
    local_out, local_lse, _, _ = forward(q, k[:, :32], v[:, :32])  # block 1's own out / lse, not the merged
    assert not within(backward(dout, q, k[:, :32], v[:, :32], out, local_lse)[0], formula, b_dq)
    assert not within(backward(dout, q, k[:, :32], v[:, :32], local_out, lse)[0], formula, b_dq)


def test_flash_attn_func_autograd_vs_float64():
    q, k, v, dout = inputs(torch.bfloat16, 2, 30, 50, 4, 2, 12, seed=13)  # head dim 12: padded to 16
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, s_dmask = fa.flash_attn_func(*leaves, causal=True, window_size=(10, -1), return_attn_probs=True)
    out.backward(dout)
    mask = ref_mask(30, 50, causal=True, window=(10, -1))
    out64, lse64, p, dq64, dk64, dv64 = reference(q, k, v, dout, mask, 12**-0.5)
    tol_out, tol_lse, a_max = fwd_bounds(q, k, v, mask, 12**-0.5, lse64)
    assert out.shape == q.shape and within(out.detach(), out64, tol_out) and within(lse, lse64, tol_lse)
    bounds = grad_bounds(q, k, v, dout, out.detach(), lse, out64, lse64, p, 12**-0.5, a_max)
    assert all(within(x.grad, r, bd) for x, r, bd in zip(leaves, (dq64, dk64, dv64), bounds, strict=True))
    with torch.no_grad():
        assert torch.equal(fa.flash_attn_func(q, k, v, causal=True, window_size=(10, -1)), out.detach())


def test_refusals_use_flash_attn_texts():
    q, k, v, dout = inputs(torch.float16, 1, 8, 8, 2, 2, 16)
    with pytest.raises(RuntimeError, match="^FlashAttention only support fp16 and bf16 data type$"):
        forward(q.float(), k.float(), v.float())
    with pytest.raises(RuntimeError, match="^FlashAttention only support fp16 and bf16 data type$"):
        fa.flash_attn_func(q.float(), k.float(), v.float())
    big = inputs(torch.float16, 1, 8, 8, 2, 2, 260)
    with pytest.raises(RuntimeError, match="^FlashAttention forward only supports head dimension at most 256$"):
        forward(*big[:3])
    with pytest.raises(RuntimeError, match="^FlashAttention forward only supports head dimension at most 256$"):
        fa.flash_attn_func(*big[:3])  # padded to 264 first, as flash-attn does
    with pytest.raises(RuntimeError, match="^head_size should be a multiple of 8$"):
        backward(big[3], *big[:3], big[3], torch.zeros(1, 2, 8))
    odd = inputs(torch.float16, 1, 8, 8, 2, 2, 12)
    with pytest.raises(RuntimeError, match="^query, key, value, and out_ must have a head_size that is a multiple"):
        forward(*odd[:3])
    with pytest.raises(NotImplementedError, match="dropout_p > 0 is not supported .*Philox"):
        fai._flash_attn_forward(q, k, v, 0.1, 0.25, False, -1, -1, 0.0, None, False)
    with pytest.raises(NotImplementedError, match="dropout_p > 0"):
        fa.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="softcap"):
        fa.flash_attn_func(q, k, v, softcap=30.0)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fa.flash_attn_func(q, k, v, alibi_slopes=torch.zeros(2))
    with pytest.raises(RuntimeError, match="^Number of heads in key/value must divide number of heads in query$"):
        forward(q, k[:, :, :1].expand(1, 8, 3, 16).contiguous(), v[:, :, :1].expand(1, 8, 3, 16).contiguous())
    with pytest.raises(RuntimeError, match="^return_softmax is only supported when p_dropout > 0.0$"):
        fai._flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, -1, 0.0, None, True)
    with pytest.raises(RuntimeError, match="Expected a value of type 'float' for argument 'softcap'"):
        fai._flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, -1, None, None, False)
    with pytest.raises(RuntimeError, match="^cu_seqlens_q must have dtype int32$"):
        cu = torch.tensor([0, 8], dtype=torch.int64)
        fai._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 8, 8, 0.0, 0.25, False)
    out, lse, _, _ = forward(q, k, v)
    with pytest.raises(RuntimeError, match="^dq must have the same dtype as q$"):
        backward(dout, q, k, v, out, lse, bufs=(torch.empty(q.shape), torch.empty_like(k), torch.empty_like(v)))


def test_signatures_match_flash_attn_2_8_3():
    """Parameter names, order and defaults copied from flash-attn v2.8.3's flash_attn_interface.py."""
    import inspect

    common = ["dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
              "alibi_slopes"]
    expected = {
        "_flash_attn_forward": (["q", "k", "v", *common, "return_softmax"], ()),
        "_flash_attn_varlen_forward": (
            ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", *common,
             "return_softmax", "block_table", "leftpad_k", "seqused_k", "zero_tensors"],
            (-1, -1, 0.0, None, False, None, None, None, False)),
        "_flash_attn_backward": (
            ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", *common, "deterministic", "rng_state"],
            (None,)),
        "_flash_attn_varlen_backward": (
            ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
             "max_seqlen_q", "max_seqlen_k", *common, "deterministic", "rng_state", "zero_tensors"], (None, False)),
    }
    for name, (args, defaults) in expected.items():
        spec = inspect.getfullargspec(getattr(fai, name))
        assert inspect.isfunction(getattr(fai, name)) and spec.args == args and (spec.defaults or ()) == defaults
    spec = inspect.getfullargspec(fa.flash_attn_func)
    assert spec.args == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                         "alibi_slopes", "deterministic", "return_attn_probs"]
    assert spec.defaults == (0.0, None, False, (-1, -1), 0.0, None, False, False)
    assert fa.__version__ == "2.8.3" and fa.__ring_harness_standin__ is True and not fa.__version__ < "2.6.3"


# ---------------------------------------------------------------- install() in a fresh interpreter


def _python(code: str, extra_path: list[str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(extra_path or []), str(ROOT)])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_install_puts_the_standin_first_when_flash_attn_is_absent():
    if flash_standin.kernel_label() not in ("none", "cpu-standin"):
        pytest.skip("a real flash-attn is installed here")
    stub_expected = not _installed("transformers")
    result = _python(f"""
        import sys
        from harness.kernels import flash_standin as fs
        assert fs.kernel_label() == "none", fs.kernel_label()
        assert fs.install() is True and sys.path[0] in (str(fs.STANDIN_DIR), str(fs.HF_STUB_DIR))
        assert fs.kernel_label() == "cpu-standin"
        import flash_attn  # without torch: flash_attn_func and flash_attn.flash_attn_interface load lazily
        assert flash_attn.__ring_harness_standin__ is True and flash_attn.__version__ == "2.8.3"
        assert flash_attn.__file__.startswith(str(fs.STANDIN_DIR)) and "torch" not in sys.modules
        assert fs.kernel_label() == "cpu-standin" and fs.install() is True
        assert sys.path.count(str(fs.STANDIN_DIR)) == 1
        import transformers  # the stub only where no real transformers is installed
        assert getattr(transformers, "__ring_harness_standin__", False) is {stub_expected}
        from transformers.modeling_flash_attention_utils import is_flash_attn_greater_or_equal_2_10
        print("OK")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr


def test_install_never_shadows_a_real_flash_attn(tmp_path):
    fake = tmp_path / "site" / "flash_attn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '2.7.4.post1'\n")
    result = _python("""
        import sys
        from harness.kernels import flash_standin as fs
        assert fs.kernel_label() == "flash-attn 2.7.4.post1", fs.kernel_label()
        assert fs.install() is False and str(fs.STANDIN_DIR) not in sys.path
        import flash_attn
        assert flash_attn.__version__ == "2.7.4.post1" and not hasattr(flash_attn, "__ring_harness_standin__")
        assert fs.install() is False and fs.kernel_label() == "flash-attn 2.7.4.post1"
        print("OK")
    """, extra_path=[str(tmp_path / "site")])
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr


def test_standin_already_on_pythonpath_is_recognised():
    """Rank processes may get standin/ through PYTHONPATH: install() then inserts nothing more."""
    if flash_standin.kernel_label() not in ("none", "cpu-standin"):
        pytest.skip("a real flash-attn is installed here")
    result = _python("""
        import sys
        from harness.kernels import flash_standin as fs
        before = sys.path.count(str(fs.STANDIN_DIR))
        assert fs.kernel_label() == "cpu-standin" and fs.install() is True
        assert before == 1 and sys.path.count(str(fs.STANDIN_DIR)) == 1
        print("OK")
    """, extra_path=[str(flash_standin.STANDIN_DIR)])
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr


# ---------------------------------------------------------------- the ring libraries on the stand-in


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.fixture
def standin_world(tmp_path, monkeypatch):
    """The stand-in installed in this process and a one-rank gloo group; both removed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    if not flash_standin.install():
        sys.path[:] = saved_path
        pytest.skip("a real flash-attn is installed here")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield monkeypatch
    dist.destroy_process_group()
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        if name.split(".")[0] in ("flash_attn", "transformers", "ring_flash_attn", "yunchang"):
            del sys.modules[name]


def _self_ring(monkeypatch, ring_comm_class) -> None:
    """gloo cannot send a rank to itself; with one rank, RingComm's send/recv is a copy (the libraries always
    send dk/dv once at the end of their backward, even with world size 1)."""
    def send_recv(self, to_send, recv_tensor=None):
        res = torch.empty_like(to_send) if recv_tensor is None else recv_tensor
        return res.copy_(to_send)

    monkeypatch.setattr(ring_comm_class, "send_recv", send_recv)
    monkeypatch.setattr(ring_comm_class, "commit", lambda self: None)
    monkeypatch.setattr(ring_comm_class, "wait", lambda self: None)


def _run(func, q, k, v, dout, **kwargs):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = func(*leaves, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dout)
    return out.detach(), *(x.grad for x in leaves)


def _check_against_standin_and_float64(got, q, k, v, dout, causal=True):
    out, lse, _, _ = forward(q, k, v, causal=causal)
    direct = (out, *backward(dout, q, k, v, out, lse, causal=causal)[:3])
    mask, scale = ref_mask(q.shape[1], k.shape[1], causal), q.shape[-1] ** -0.5
    out64, lse64, p, *grads64 = reference(q, k, v, dout, mask, scale)
    tol_out, tol_lse, a_max = fwd_bounds(q, k, v, mask, scale, lse64)
    bounds = (tol_out, *grad_bounds(q, k, v, dout, out, lse, out64, lse64, p, scale, a_max))
    assert all(within(x, r, bd) for x, r, bd in zip(got, (out64, *grads64), bounds, strict=True))
    return direct


@pytest.mark.extra
@pytest.mark.skipif(not _installed("ring_flash_attn"), reason="ring-flash-attn is not installed")
def test_ring_flash_attn_runs_on_the_standin(standin_world):
    import ring_flash_attn
    from ring_flash_attn import utils

    _self_ring(standin_world, utils.RingComm)
    q, k, v, dout = inputs(torch.bfloat16, 1, 32, 32, 4, 2, 16, seed=17)
    for func in (ring_flash_attn.ring_flash_attn_func, ring_flash_attn.zigzag_ring_flash_attn_func):
        got = _run(func, q, k, v, dout, causal=True)
        direct = _check_against_standin_and_float64(got, q, k, v, dout)
        assert all(torch.equal(a, b) for a, b in zip(got, direct, strict=True))  # one rank: one kernel call


@pytest.mark.extra
@pytest.mark.skipif(not _installed("ring_flash_attn"), reason="ring-flash-attn is not installed")
def test_ring_flash_attn_llama3_varlen_on_the_standin(standin_world):
    import torch.distributed as dist
    from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func

    cu = torch.tensor([0, 10, 30, 48], dtype=torch.int32)
    q, k, v, dout = (x[0] for x in inputs(torch.float16, 1, 48, 48, 4, 2, 16, seed=19))
    cu_q, cu_k, max_q, max_k, local_k = llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, 1)
    got = _run(llama3_flash_attn_varlen_func, q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
               max_seqlen_q=max_q, max_seqlen_k=max_k, heads_k_stride=1, local_k_slice=local_k, causal=True,
               group=dist.group.WORLD)
    for b in range(3):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = [x[rows].unsqueeze(0) for x in (q, k, v, dout)]
        _check_against_standin_and_float64([x[rows].unsqueeze(0) for x in got], *one)


@pytest.mark.extra
@pytest.mark.skipif(not _installed("ring_flash_attn"), reason="ring-flash-attn is not installed")
def test_ring_flash_attn_0_1_8_rounds_fp16_dq_through_bf16(standin_world):
    """ring_flash_attn.py:154 (0.1.8) returns `dq.to(torch.bfloat16)`; autograd casts it back to fp16."""
    import importlib.metadata

    import ring_flash_attn
    from ring_flash_attn import utils

    if importlib.metadata.version("ring-flash-attn") != "0.1.8":
        pytest.skip("pins a bug of ring-flash-attn 0.1.8")
    _self_ring(standin_world, utils.RingComm)
    q, k, v, dout = inputs(torch.float16, 1, 32, 32, 2, 2, 16, seed=23)
    got = _run(ring_flash_attn.ring_flash_attn_func, q, k, v, dout, causal=True)
    out, lse, _, _ = forward(q, k, v, causal=True)
    dq = backward(dout, q, k, v, out, lse, causal=True)[0]
    assert torch.equal(got[1], dq.to(torch.bfloat16).to(torch.float16)) and not torch.equal(got[1], dq)


@pytest.mark.extra
@pytest.mark.skipif(not _installed("yunchang"), reason="yunchang is not installed")
def test_yunchang_ring_runs_on_the_standin(standin_world):
    from yunchang.ring import ring_flash_attn_func, utils, zigzag_ring_flash_attn_func

    _self_ring(standin_world, utils.RingComm)
    q, k, v, dout = inputs(torch.bfloat16, 1, 32, 32, 4, 2, 16, seed=29)
    for func in (ring_flash_attn_func, zigzag_ring_flash_attn_func):
        got = _run(func, q, k, v, dout, causal=True)
        direct = _check_against_standin_and_float64(got, q, k, v, dout)
        assert all(torch.equal(a, b) for a, b in zip(got, direct, strict=True))


@pytest.mark.extra
@pytest.mark.skipif(not _installed("yunchang"), reason="yunchang is not installed")
def test_yunchang_0_6_4_varlen_ring_predates_flash_attn_2_6(standin_world):
    """yunchang/ring/ring_flash_attn_varlen.py calls _flash_attn_varlen_forward(..., window_size=...) and
    unpacks 8 outputs: flash-attn < 2.6 signatures, which 2.8.3 (and so the stand-in) does not accept."""
    from yunchang.ring import ring_flash_attn_varlen_func

    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    q, k, v, _ = (x[0] for x in inputs(torch.bfloat16, 1, 32, 32, 2, 2, 16))
    with pytest.raises(TypeError, match="window_size"):
        ring_flash_attn_varlen_func(q, k, v, cu, 16, causal=True)
