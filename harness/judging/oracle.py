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
    term_scale: dict[str, dict[str, float]] = field(default_factory=dict)  # tensor -> {rounding class: scale}


class TermScales:
    """The magnitude of the terms each result is summed from, accumulated over query blocks in float64
    (not of the result itself, which can be exactly 0, e.g. dq of a query that sees one key). With p the
    probabilities, dP = dout . v, D = dout . out and dS = p (dP - D) (per query head; dk, dv sum
    over the query heads of each kv head's group):

    out  terms   max_{i,d} sum_j p_ij |v_jd|                     (A = that, dotted with |dout_i|)
    dq   terms   scale max|k| max_i sum_j |dS_ij|;   D   scale max|k| max_i A_i
    dk   terms   scale max|q| max_j sum_i |dS_ij|;   D   scale max|q| max_j sum_i p_ij A_i
    dv   terms   max|dout| max_j sum_i p_ij
    lse  terms   scale max|q| max|k|

    A_i = sum_j p_ij sum_d |dout_id| |v_jd| bounds the error of D_i made by rounding P, partial
    outputs and out, and D itself (harness/judging/tolerance.py, docs/tolerance.md)."""

    def __init__(self, k: torch.Tensor) -> None:
        b, n, hkv, _ = k.shape
        self.out = self.dq = self.dq_d = 0.0
        self.col_ds, self.col_pa, self.col_p = (torch.zeros(b, hkv, n, dtype=k.dtype) for _ in range(3))

    def add(self, p, v, dout, out, lo: int, hi: int, groups: int) -> None:
        """One query block: p (B, H, q, keys lo:hi), v its keys' values, dout/out its queries'."""
        with torch.no_grad():
            vv = v.repeat_interleave(groups, dim=2) if groups > 1 else v
            pv = torch.einsum("bhqk,bkhd->bqhd", p, vv.abs())
            a = (dout.abs() * pv).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # (B, H, q, 1)
            dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
            delta = (dout * out).sum(dim=-1).transpose(1, 2).unsqueeze(-1)
            ds = p * (dp - delta).abs()
            self.out = max(self.out, float(pv.max()))
            self.dq = max(self.dq, float(ds.sum(dim=-1).max()))
            self.dq_d = max(self.dq_d, float(a.max()))
            b, h, _, n = p.shape
            for acc, x in ((self.col_ds, ds), (self.col_pa, p * a), (self.col_p, p)):
                acc[:, :, lo:hi] += x.sum(dim=2).view(b, h // groups, groups, n).sum(dim=2)

    def scales(self, q, k, dout, scale: float) -> dict[str, dict[str, float]]:
        mq, mk, mdo = (float(t.detach().abs().max()) if t.numel() else 0.0 for t in (q, k, dout))
        top = {n: float(t.max()) if t.numel() else 0.0
               for n, t in (("ds", self.col_ds), ("pa", self.col_pa), ("p", self.col_p))}
        return {"out": {"terms": self.out}, "lse": {"terms": scale * mq * mk},
                "dq": {"terms": scale * mk * self.dq, "D": scale * mk * self.dq_d},
                "dk": {"terms": scale * mq * top["ds"], "D": scale * mq * top["pa"]},
                "dv": {"terms": mdo * top["p"]}}


def _block(q, k, v, mask, scale, groups):
    """Plain attention of a query block against all keys: (out, lse, p). Differentiable."""
    kk = k.repeat_interleave(groups, dim=2) if groups > 1 else k
    vv = v.repeat_interleave(groups, dim=2) if groups > 1 else v
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, dim=-1)
    p = torch.softmax(s, dim=-1).to(v.dtype)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key (never happens globally)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out, lse, p


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
    terms = TermScales(k) if compute == torch.float64 else None  # from the float64 reference only
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for start in range(0, n, QUERY_BLOCK):
        stop = min(n, start + QUERY_BLOCK)
        qb = q[:, start:stop].clone().requires_grad_(True)
        m = allowed(mask, pos[start:stop], pos)
        lo, hi = _key_span(m, n)  # keys outside it are masked for the whole block: exact zeros, skipped
        kb = k[:, lo:hi].detach().requires_grad_(True)
        vb = v[:, lo:hi].detach().requires_grad_(True)
        out, lse, p = _block(qb, kb, vb, None if m is None else m[:, lo:hi], scale, groups)
        gq, gk, gv = torch.autograd.grad(out, (qb, kb, vb), dout[:, start:stop])
        outs.append(out.detach())
        lses.append(lse.detach())
        dqs.append(gq)
        dk[:, lo:hi] += gk
        dv[:, lo:hi] += gv
        if terms is not None and hi > lo:
            terms.add(p.detach(), vb.detach(), dout[:, start:stop], out.detach(), lo, hi, groups)
    scales = terms.scales(q, k, dout, scale) if terms is not None else {}
    return Reference(torch.cat(outs, 1), torch.cat(lses, 2), torch.cat(dqs, 1), dk, dv, scales)


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
