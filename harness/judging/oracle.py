"""The oracle: single-device full attention with the explicit mask, forward and backward.

`attention(..., compute=float64)` is the reference every rank is judged against; the same code in
the case's own dtype is the `base` whose error sets the tolerance. Computed in blocks of queries
(autograd per block) so memory is O(block x n), not O(n^2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness import inputs
from harness.dtypes import TORCH_DTYPES
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
    term_scale: dict[str, float] = field(default_factory=dict)


def term_scales(q, k, v, dout, scale: float) -> dict[str, float]:
    """The magnitude of the terms each result is summed from (not of the result itself, which can
    be exactly 0, e.g. dq of a query that sees a single key): out = sum p v; lse ~ scale q.k;
    dq = scale sum dS k and dk = scale sum dS q with dS ~ p (dout.v); dv = sum p dout."""
    m = {n: float(t.detach().abs().max()) if t.numel() else 0.0
         for n, t in (("q", q), ("k", k), ("v", v), ("dout", dout))}
    return {"out": m["v"], "lse": scale * m["q"] * m["k"], "dq": scale * m["dout"] * m["v"] * m["k"],
            "dk": scale * m["dout"] * m["v"] * m["q"], "dv": m["dout"]}


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


def _key_span(m: torch.Tensor | None, n: int) -> tuple[int, int]:
    """[lo, hi): the keys some query of the block may see (all keys without a mask). Causal, window
    and document masks leave most keys of early or narrow blocks out: up to 2x less work causal."""
    if m is None:
        return 0, n
    cols = m.any(dim=0).nonzero()
    return (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 0)


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
        lo, hi = _key_span(m, n)  # keys outside it are masked for the whole block: exact zeros, skipped
        kb = k[:, lo:hi].detach().requires_grad_(True)
        vb = v[:, lo:hi].detach().requires_grad_(True)
        out, lse = _block(qb, kb, vb, None if m is None else m[:, lo:hi], scale, groups)
        gq, gk, gv = torch.autograd.grad(out, (qb, kb, vb), dout[:, start:stop])
        outs.append(out.detach())
        lses.append(lse.detach())
        dqs.append(gq)
        dk[:, lo:hi] += gk
        dv[:, lo:hi] += gv
    return Reference(torch.cat(outs, 1), torch.cat(lses, 2), torch.cat(dqs, 1), dk, dv,
                     term_scales(q, k, v, dout, scale))


_CACHE: dict[str, tuple[Reference, Reference]] = {}
_CACHE_MAX = 8


def references(case) -> tuple[Reference, Reference]:
    """(float64 reference, same-dtype base) for a case; cached because shrinking and replays
    re-run the same inputs under other implementations or faults."""
    key = case.replace(impl="-", faults=(), tolerance={}, deadline_s=1.0).key()
    if key not in _CACHE:
        g = inputs.make_global(case)
        args = (g["q"], g["k"], g["v"], g["dout"], case.mask, case.scale)
        ref = attention(*args, compute=torch.float64)
        base = attention(*args, compute=TORCH_DTYPES[case.dtype])
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (ref, base)
    return _CACHE[key]
