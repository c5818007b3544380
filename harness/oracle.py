"""The oracle: single-device full attention with the explicit mask, forward and backward.

`attention(..., compute=float64)` is the reference every rank is judged against; the same code in
the case's own dtype is the `base` whose error sets the tolerance. Computed in blocks of queries
(autograd per block) so memory is O(block x n), not O(n^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ring_impl.masks import MaskSpec, allowed

QUERY_BLOCK = 1024


@dataclass
class Reference:
    """Global out, lse and q/k/v gradients, all in the compute dtype."""

    out: torch.Tensor  # (B, N, Hq, D)
    lse: torch.Tensor  # (B, Hq, N)
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def _block(q, k, v, mask, scale, groups):
    """Plain attention of a query block against all keys: (out, lse). Differentiable."""
    kk = k.repeat_interleave(groups, dim=2) if groups > 1 else k
    vv = v.repeat_interleave(groups, dim=2) if groups > 1 else v
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, dim=-1)
    p = torch.softmax(s, dim=-1).to(v.dtype)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key (never happens globally)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out, lse


def attention(q, k, v, dout, mask: MaskSpec, scale: float, compute: torch.dtype) -> Reference:
    """Forward + backward of full attention computed in `compute`; inputs are cast to it."""
    q, k, v, dout = (t.detach().to(compute) for t in (q, k, v, dout))
    n = q.shape[1]
    groups = q.shape[2] // k.shape[2]
    pos = torch.arange(n, dtype=torch.long)
    k = k.requires_grad_(True)
    v = v.requires_grad_(True)
    outs, lses, dqs = [], [], []
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for start in range(0, n, QUERY_BLOCK):
        stop = min(n, start + QUERY_BLOCK)
        qb = q[:, start:stop].clone().requires_grad_(True)
        m = allowed(mask, pos[start:stop], pos)
        out, lse = _block(qb, k, v, m, scale, groups)
        gq, gk, gv = torch.autograd.grad(out, (qb, k, v), dout[:, start:stop])
        outs.append(out.detach())
        lses.append(lse.detach())
        dqs.append(gq)
        dk += gk
        dv += gv
    return Reference(torch.cat(outs, 1), torch.cat(lses, 2), torch.cat(dqs, 1), dk, dv)
