"""The oracle's share of one rank: float64 reference and same-dtype base for the rank's own query rows.

The oracle is partitioned by the case, never by who computes it: share `g` of a W-rank case is the
float64 (and base-dtype) attention of the global query rows rank g holds under the case's layout,
against every key, in query blocks of `query_block(case)` rows, with

- out, lse, dq of those rows,
- dk, dv *partials*: every key's gradient from those rows only (the full dk/dv is the sum of the W
  partials, in rank order),
- the term-scale partials the tolerance rule needs (float64 only; `TermScales`).

The ranks compute their own share on their own device (pool workers: one CPU thread each; torchrun:
cuda:LOCAL_RANK) after the implementation's run, outside the fault interposer, from the global k/v and
their own q/dout rows rebuilt from the case seed (`harness.inputs`); `harness.judging.oracle.assemble`
puts the W shares together in one place. The local oracle (`--oracle local`, the tests' referee) runs
the same W shares one after another in one process and assembles them the same way, so on CPU the two
are bit-identical by construction.

The float64 reference has a hand-written backward (dP = dO V^T, D = rowsum(dO * O), dS = P (dP - D),
dQ = s dS K, dK = s dS^T Q, dV = P^T dO) that shares P, dP and dS with the term scales; the base keeps
autograd through plain attention in the case's dtype (its roundings are what the tolerance's `base`
term measures: docs/tolerance.md). A query that sees no key gets out = 0, lse = -inf, dq = 0 and
contributes nothing to dk/dv (never NaN).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import torch

from harness import inputs
from harness.case import Case
from harness.dtypes import TORCH_DTYPES
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec, allowed

SCORE_BUDGET = 1 << 22  # score entries (batch x query heads x queries x keys) of one query block: 32 MiB float64
MAX_QUERY_BLOCK = 1024
MIN_QUERY_BLOCK = 16


def _libc_trim():
    """glibc's malloc_trim, or a no-op elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda pad: 0


_TRIM = _libc_trim()


def query_block(case: Case) -> int:
    """Queries per block: as many as keep one block's scores within SCORE_BUDGET entries (a few float64
    temporaries of that size live at once), between MIN_QUERY_BLOCK and MAX_QUERY_BLOCK. A function of
    the case only, so every way of computing the oracle uses the same blocks."""
    per_query = max(1, case.batch * case.heads_q * case.total_len)
    return max(MIN_QUERY_BLOCK, min(MAX_QUERY_BLOCK, SCORE_BUDGET // per_query))


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
    outputs and out, and D itself (harness/judging/tolerance.py, docs/tolerance.md).

    One rank's share holds its rows' maxima and its rows' column sums (every key); `merge` combines
    shares (maxima: max; column sums: added in rank order) and `scales` turns them into the table."""

    def __init__(self, k: torch.Tensor) -> None:
        b, n, hkv, _ = k.shape
        self.out = self.dq = self.dq_d = 0.0
        self.max_q = self.max_dout = 0.0
        self.max_k = float(k.abs().max()) if k.numel() else 0.0
        self.col_ds, self.col_pa, self.col_p = (torch.zeros(b, hkv, n, dtype=torch.float64, device=k.device)
                                                for _ in range(3))

    def add(self, p, v_abs, dout, ds_abs, lo: int, hi: int) -> None:
        """One query block, grouped layout: p and ds_abs (B, Hkv, g, q, keys lo:hi), v_abs (B, keys, Hkv, D),
        dout (B, q, Hkv, g, D)."""
        pv = torch.einsum("bhgqk,bkhd->bqhgd", p, v_abs)
        a = (dout.abs() * pv).sum(dim=-1).permute(0, 2, 3, 1)  # (B, Hkv, g, q)
        self.out = max(self.out, float(pv.max()))
        self.dq = max(self.dq, float(ds_abs.sum(dim=-1).max()))
        self.dq_d = max(self.dq_d, float(a.max()))
        self.col_ds[:, :, lo:hi] += ds_abs.sum(dim=(2, 3))
        self.col_pa[:, :, lo:hi] += torch.einsum("bhgqk,bhgq->bhk", p, a)
        self.col_p[:, :, lo:hi] += p.sum(dim=(2, 3))

    def to(self, device: torch.device | str) -> TermScales:
        """The same scales with their column sums on `device` (for sending back to the parent)."""
        for name in ("col_ds", "col_pa", "col_p"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def merge(self, other: TermScales) -> None:
        """Add another share's rows (call in rank order: the column sums are float64 additions)."""
        for name in ("out", "dq", "dq_d", "max_q", "max_dout", "max_k"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        for name in ("col_ds", "col_pa", "col_p"):
            getattr(self, name).add_(getattr(other, name))

    def scales(self, scale: float) -> dict[str, dict[str, float]]:
        """{tensor: {rounding class: scale}} for the tolerance rule."""
        mq, mk, mdo = self.max_q, self.max_k, self.max_dout
        top = {n: float(t.max()) if t.numel() else 0.0
               for n, t in (("ds", self.col_ds), ("pa", self.col_pa), ("p", self.col_p))}
        return {"out": {"terms": self.out}, "lse": {"terms": scale * mq * mk},
                "dq": {"terms": scale * mk * self.dq, "D": scale * mk * self.dq_d},
                "dk": {"terms": scale * mq * top["ds"], "D": scale * mq * top["pa"]},
                "dv": {"terms": mdo * top["p"]}}


@dataclass
class Share:
    """One rank's share of the oracle in one compute dtype: its query rows' out/lse/dq, every key's
    dk/dv partial from those rows, and (float64 only) the term-scale partials."""

    rows: torch.Tensor  # (r,) global query positions, in the order of the rows below
    out: torch.Tensor  # (B, r, Hq, D)
    lse: torch.Tensor  # (B, Hq, r)
    dq: torch.Tensor  # (B, r, Hq, D)
    dk: torch.Tensor  # (B, N, Hkv, D): partial (float32 for a bf16/fp16 base: rounded once, when assembled)
    dv: torch.Tensor  # (B, N, Hkv, D): partial
    terms: TermScales | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def cpu(self) -> Share:
        """The same share with every tensor on the CPU."""
        for name in ("rows", "out", "lse", "dq", "dk", "dv"):
            setattr(self, name, getattr(self, name).cpu())
        if self.terms is not None:
            self.terms.to("cpu")
        return self


def key_span(m: torch.Tensor | None, n: int) -> tuple[int, int]:
    """[lo, hi): the keys some query of the block may see (all keys without a mask). Causal, window
    and document masks leave most keys of early or narrow blocks out: up to 2x less work causal."""
    if m is None:
        return 0, n
    cols = m.any(dim=0).nonzero()
    return (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 0)


def _grouped(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, r, Hq, D) -> (B, r, Hkv, g, D): query head h belongs to kv head h // g."""
    b, r, hq, d = t.shape
    return t.view(b, r, hkv, hq // hkv, d)


def _exact_block(q, k, v, dout, m, scale: float, dk, dv, lo: int, hi: int, terms: TermScales | None):
    """Float64 forward + hand-written backward of one query block against keys lo:hi (grouped layout:
    q, dout (B, r, Hkv, g, D); k, v (B, N, Hkv, D)); adds into dk/dv[:, lo:hi]. Returns (out, lse, dq)."""
    kb, vb = k[:, lo:hi], v[:, lo:hi]
    s = torch.einsum("bqhgd,bkhd->bhgqk", q, kb).mul_(scale)
    if m is not None:
        s.masked_fill_(~m, float("-inf"))
    mx = s.amax(dim=-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # a row that sees no key: p = 0
    p = s.sub_(mx).exp_()
    total = p.sum(dim=-1, keepdim=True)
    lse = (mx + total.log()).squeeze(-1)  # log 0 = -inf for a row that sees no key
    p.div_(torch.where(total > 0, total, torch.ones_like(total)))
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, vb)
    delta = (dout * out).sum(dim=-1).permute(0, 2, 3, 1).unsqueeze(-1)  # (B, Hkv, g, q, 1)
    ds = torch.einsum("bqhgd,bkhd->bhgqk", dout, vb).sub_(delta).mul_(p)
    if terms is not None:
        terms.add(p, vb.abs(), dout, ds.abs(), lo, hi)
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, kb).mul_(scale)
    dk[:, lo:hi] += torch.einsum("bhgqk,bqhgd->bkhd", ds, q).mul_(scale)
    dv[:, lo:hi] += torch.einsum("bhgqk,bqhgd->bkhd", p, dout)
    return out, lse, dq


def _plain_block(q, k, v, dout, m, scale: float, groups: int):
    """Plain attention of one query block in the case's dtype, as a naive implementation would do it (the
    tolerance's `base`): (out, lse, dq, dk, dv). out, lse and dq as autograd gives them in the dtype; dk and
    dv are the float32 sums of the dtype's products (what a dtype matmul accumulates before rounding its
    result), unrounded, so that the blocks' and shares' partials add up in float32 and are rounded to the
    dtype once (`harness.judging.oracle.assemble`), as by one matmul over every query."""
    q = q.detach().requires_grad_(True)
    kk = k.repeat_interleave(groups, dim=2) if groups > 1 else k
    vv = v.repeat_interleave(groups, dim=2) if groups > 1 else v
    raw = torch.einsum("bqhd,bkhd->bhqk", q, kk)
    s = raw * scale
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, dim=-1)
    if m is not None and not bool(m.any(dim=1).all()):  # rows that see no key: p = 0, not NaN
        s = s.masked_fill(~m.any(dim=1).view(-1, 1), 0.0)
        p = torch.softmax(s, dim=-1).masked_fill(~m, 0.0).to(v.dtype)
    else:
        p = torch.softmax(s, dim=-1).to(v.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    dq, draw = torch.autograd.grad(out, (q, raw), dout)
    b, hq, r, n = p.shape
    dk = torch.einsum("bhqk,bqhd->bkhd", draw.float(), q.detach().float())
    dv = torch.einsum("bhqk,bqhd->bkhd", p.detach().float(), dout.float())
    if groups > 1:
        dk = dk.view(b, n, hq // groups, groups, -1).sum(dim=3)
        dv = dv.view(b, n, hq // groups, groups, -1).sum(dim=3)
    return out.detach(), lse.detach(), dq, dk, dv


def attend(q, k, v, dout, rows: torch.Tensor, mask: MaskSpec, scale: float, compute: torch.dtype,
           block: int, terms: bool = False) -> Share:
    """The share of query rows `rows` (global positions; q and dout hold those rows in that order)
    against all keys (k, v global), in `compute`, in blocks of `block` rows. `terms`: also the
    term-scale partials (float64 only)."""
    t0 = time.perf_counter()
    q, k, v, dout = (t.detach().to(compute) for t in (q, k, v, dout))
    b, n, hkv, d = k.shape
    hq = q.shape[2]
    groups = hq // hkv
    kpos = torch.arange(n, dtype=torch.long, device=rows.device)
    exact = compute == torch.float64
    # the base's dk/dv: each block's gradient (rounded to the dtype by autograd) is accumulated in float32 over
    # blocks and shares and rounded to the dtype once, in `assemble` (plain attention's one matmul over every
    # query: partitioning must not add roundings)
    acc = compute if exact or compute == torch.float32 else torch.float32
    dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    ts = TermScales(k) if terms and exact else None
    if ts is not None:
        ts.max_q = float(q.abs().max()) if q.numel() else 0.0
        ts.max_dout = float(dout.abs().max()) if dout.numel() else 0.0
    outs, lses, dqs = [], [], []
    with torch.no_grad() if exact else torch.enable_grad():
        for start in range(0, rows.numel(), block):
            stop = min(rows.numel(), start + block)
            qb, db = q[:, start:stop], dout[:, start:stop]
            m = allowed(mask, rows[start:stop], kpos)
            lo, hi = key_span(m, n)  # keys outside it are masked for the whole block: exact zeros, skipped
            mb = None if m is None else m[:, lo:hi]
            if hi <= lo:  # no query of the block sees any key: out = dq = 0, lse = -inf, no dk/dv
                out, dq = q.new_zeros(qb.shape), q.new_zeros(qb.shape)
                lse = torch.full((b, hq, stop - start), float("-inf"), device=q.device,
                                 dtype=compute if exact else torch.float32)
            elif exact:
                out, lse, dq = _exact_block(_grouped(qb, hkv), k, v, _grouped(db, hkv), mb, scale, dk, dv, lo, hi, ts)
                out, dq = out.reshape(b, -1, hq, d), dq.reshape(b, -1, hq, d)
                lse = lse.reshape(b, hq, -1)
            else:
                out, lse, dq, gk, gv = _plain_block(qb, k[:, lo:hi], v[:, lo:hi], db, mb, scale, groups)
                dk[:, lo:hi] += gk.to(acc)
                dv[:, lo:hi] += gv.to(acc)
            outs.append(out)
            lses.append(lse)
            dqs.append(dq)
            # give the block's freed temporaries back: their sizes change with every key span, and glibc's heap
            # otherwise keeps the holes (measured: 1.15 GiB instead of 0.5 GiB peak RSS for a 16k share)
            _TRIM(0)
    empty = q.new_zeros(b, 0, hq, d)
    out = torch.cat(outs, 1) if outs else empty
    lse = torch.cat(lses, 2) if lses else q.new_zeros(b, hq, 0, dtype=torch.float32 if not exact else compute)
    dq = torch.cat(dqs, 1) if dqs else empty
    return Share(rows, out, lse, dq, dk, dv, ts, time.perf_counter() - t0)


def rows_of(case: Case, share: int) -> torch.Tensor:
    """The global query rows of share `share` (group rank): the positions that rank holds."""
    return all_positions(case.layout, case.seq_lens)[share]


def share(case: Case, index: int, device: torch.device | str = "cpu") -> tuple[Share, Share]:
    """(float64 reference share, same-dtype base share) number `index` (a group rank) of the case's
    oracle, computed on `device` from inputs rebuilt from the seed."""
    t0 = time.perf_counter()
    _TRIM(0)  # what the rank's run left in glibc's heap goes back first: the share's peak is its own
    rows = rows_of(case, index)
    keys = torch.arange(case.total_len, dtype=torch.long)
    q, dout = (inputs.make(case, name, rows).to(device) for name in ("q", "dout"))
    k, v = (inputs.make(case, name, keys).to(device) for name in ("k", "v"))
    t_in = time.perf_counter() - t0
    block = query_block(case)
    rows_d = rows.to(device)
    ref = attend(q, k, v, dout, rows_d, case.mask, case.scale, torch.float64, block, terms=True)
    base = attend(q, k, v, dout, rows_d, case.mask, case.scale, TORCH_DTYPES[case.dtype], block)
    ref.extra = {"inputs_s": t_in, "block": block}
    return ref.cpu(), base.cpu()
