"""The float64 referee of the flash-attn stand-in's tests and the bounds it is held to.

The reference is written here: einsum over a brute-force boolean mask from a double loop, nothing
from the harness. The stand-in is loaded under a private module name, so the test process never
gets a `flash_attn` module.

Tolerances are derived, not guessed. u = unit roundoff of the input dtype (2^-11 fp16, 2^-8
bf16), u32 = 2^-24; the reference runs on the same rounded inputs, so input rounding costs
nothing. forward
|out - out64| <= 1.1 (2u + fp16_sub + 2 d u32 A + 2 (sk + 4) u32) max|v|: u for rounding P to the
          dtype before P @ V (|sum_j (P~_j - P_j) v_j| / l <= u max|v|), u for the final cast, the rest fp32
          (A = max scale sum_c |q_c k_c| bounds the dot-product error of S, d u32 A; fp16_sub = sk 2^-25 for
          P in fp16's subnormal range). |lse - lse64| <= 2 (d u32 A + (sk + 4) u32 + u32 max|lse|).
backward  elementwise first-order bounds (`grad_bounds`) built from float64 P, dP, D, dS and the
          errors of the out and lse the backward is given (it recomputes P from that lse and D
          from that out): eps_P = |lse - lse64| + 2 d u32 A + 4 u32 (relative error of the fp32
          P), |D err| =
          |dO . (out - out64)| + d u32 sum|dO out|; dS rounded to the dtype (u |dS|) plus those errors;
          dQ = scale dS K, dK = scale dS^T Q (fp32 sums: sk u32, sq u32), dV = P~^T dO (u for P~); each cast
          to the dtype (u |.|), dK/dV once more per query head before the GQA group sum; times 1.1.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import torch

from harness.kernels import flash_standin

U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
U32 = 2.0**-24
HALF = [torch.float16, torch.bfloat16]


def _load_private():
    name = "_rh_flash_standin_under_test"
    if name not in sys.modules:
        folder = flash_standin.STANDIN_DIR / "flash_attn"
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name], importlib.import_module(name + ".flash_attn_interface")


fa, fai = _load_private()


def ref_mask(
    sq: int, sk: int, causal: bool = False, window: tuple[int, int] = (-1, -1)
) -> torch.Tensor:
    """flash_attn_func's docstring: query i sees keys i + sk - sq - left ..= i + sk - sq + right, -1
    = no limit."""
    left, right = window
    right = 0 if causal else right
    rows = []
    for i in range(sq):
        diag = i + sk - sq
        rows.append(
            [(left < 0 or j >= diag - left) and (right < 0 or j <= diag + right) for j in range(sk)]
        )
    return torch.tensor(rows, dtype=torch.bool).reshape(sq, sk)


def heads(x: torch.Tensor, n: int, modulo: bool = False) -> torch.Tensor:
    """(b, s, hk, d) -> (b, n, s, d) float64: query head i reads kv head i // (n // hk) (or i %
    hk)."""
    hk = x.shape[2]
    idx = torch.arange(n) % hk if modulo else torch.arange(n) // (n // hk)
    return x.double()[:, :, idx].permute(0, 2, 1, 3)


def reference(q, k, v, dout, mask, scale, modulo=False):
    """float64 out (b, sq, h, d), lse (b, h, sq) (-inf: no key), P (b, h, sq, sk) and autograd dq,
    dk, dv."""
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
    a = (
        torch.einsum("bhqd,bhkd->bhqk", heads(q, q.shape[2]).abs(), heads(k, q.shape[2]).abs())
        * scale
    )
    a_max = float(a.masked_fill(~mask, 0).max()) if mask.any() else 0.0
    sub = sk * 2.0**-25 if q.dtype == torch.float16 else 0.0
    tol_out = (
        1.1
        * (2 * u + sub + 2 * d * U32 * a_max + 2 * (sk + 4) * U32)
        * float(v.double().abs().max())
    )
    finite = lse64[torch.isfinite(lse64)]
    lse_max = float(finite.abs().max()) if finite.numel() else 0.0
    tol_lse = 2 * (d * U32 * a_max + (sk + 4) * U32 + U32 * lse_max)
    return tol_out, tol_lse, a_max


def grad_bounds(q, k, v, dout, out, lse, out64, lse64, p, scale, a_max):
    """Elementwise first-order bounds on |dq - dq64|, |dk - dk64|, |dv - dv64| (layouts as q, k,
    v) for a backward given the stand-in's `out` and `lse`: their actual errors enter through D
    and P."""
    u, d = U[q.dtype], q.shape[-1]
    (b, sq, hq, _), (sk, hk) = q.shape, k.shape[1:3]
    # fp16 subnormal spacing: absolute rounding error
    sub = 2.0**-25 if q.dtype == torch.float16 else 0.0
    qh, kh, vh, doh, oh = (
        heads(q, hq),
        heads(k, hq),
        heads(v, hq),
        heads(dout, hq),
        out64.permute(0, 2, 1, 3),
    )
    err_lse = torch.where(
        torch.isfinite(lse64), (lse.double() - lse64).abs(), torch.zeros_like(lse64)
    )
    # relative error of the stand-in's fp32 P
    eps_p = err_lse.unsqueeze(-1) + 2 * d * U32 * a_max + 4 * U32
    dp = torch.einsum("bhqd,bhkd->bhqk", doh, vh)
    delta = (doh * oh).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    err_out = heads(out, hq) - oh
    err_delta = (doh * err_out).sum(-1, keepdim=True).abs() + d * U32 * (
        doh * heads(out, hq)
    ).abs().sum(-1, True)
    f = torch.einsum("bhqd,bhkd->bhqk", doh.abs(), vh.abs())
    err_ds = ds.abs() * (eps_p + u) + p * (d * U32 * f + err_delta) + sub
    dq_h = torch.einsum("bhqk,bhkd->bhqd", ds, kh) * scale
    dk_h = torch.einsum("bhqk,bhqd->bhkd", ds, qh) * scale
    dv_h = torch.einsum("bhqk,bhqd->bhkd", p, doh)
    b_dq = (
        scale * torch.einsum("bhqk,bhkd->bhqd", err_ds + sk * U32 * ds.abs(), kh.abs())
        + u * dq_h.abs()
    )
    b_dk = (
        scale * torch.einsum("bhqk,bhqd->bhkd", err_ds + sq * U32 * ds.abs(), qh.abs())
        + 2 * u * dk_h.abs()
    )
    b_dv = (
        torch.einsum("bhqk,bhqd->bhkd", (u + eps_p + sq * U32) * p + sub, doh.abs())
        + 2 * u * dv_h.abs()
    )

    def per_kv_head(x):  # (b, hq, sk, d) -> (b, sk, hk, d), summed over each group
        return x.reshape(b, hk, hq // hk, sk, d).sum(2).permute(0, 2, 1, 3)

    return 1.1 * b_dq.permute(0, 2, 1, 3), 1.1 * per_kv_head(b_dk), 1.1 * per_kv_head(b_dv)


def within(x: torch.Tensor, ref: torch.Tensor, bound) -> bool:
    return bool(((x.double() - ref).abs() <= bound).all())


def inputs(dtype, b, sq, sk, h, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, generator=g).to(dtype)
        for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))
    ]


def forward(q, k, v, causal=False, window=(-1, -1), scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fai._flash_attn_forward(
        q, k, v, 0.0, scale, causal, window[0], window[1], 0.0, None, False
    )


def backward(dout, q, k, v, out, lse, causal=False, window=(-1, -1), scale=None, bufs=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = bufs or (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    softmax_d = fai._flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
        0.0,
        scale,
        causal,
        window[0],
        window[1],
        0.0,
        None,
        False,
    )
    return dq, dk, dv, softmax_d
