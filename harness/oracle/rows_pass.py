"""The oracle's rows pass over one share: its query rows against every key.

`rows_part` gives out, lse and dq of the share's rows, and the rows' statistics the keys passes
need (`RowStats`), float64 and the same-dtype base side by side. Three sweeps run over the key
blocks, tile by tile. docs/oracle.md has the derivation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from harness.oracle.numerics import (
    Norm,
    ScoreRounding,
    amax,
    group_heads,
    keys_t,
    kv_heads,
    lo_matmul,
    load,
    norm_rows,
    normaliser,
    online,
    operands,
    probs,
    rounder,
    ungroup_heads,
)
from harness.oracle.parts import Fetch, RowsPart
from harness.oracle.tile_store import TileStore
from harness.oracle.tiles import runs, trimmer, visible_tiles
from harness.oracle.variant import PLAIN, TileVariant, sink_grads
from ring_impl.masks import MaskSpec


@dataclass(frozen=True)
class _RowsSweep:
    """What every sweep of a rows pass reads: the share's rows, the key blocks and the rounding."""

    fetch: Fetch
    rows: torch.Tensor
    qblocks: list[tuple[int, int]]
    key_blocks: Sequence[torch.Tensor]
    mask: MaskSpec
    scale: float
    dtype: torch.dtype
    sr: ScoreRounding
    trim: Callable[[int], int]
    variant: TileVariant = PLAIN
    store: TileStore | None = None  # one pass: the gradient sweep's tiles, for the keys pass

    def tiles(self, q: torch.Tensor, dout: torch.Tensor) -> Iterator[tuple]:
        """Every tile in which some query sees some key: queries a:z, mask, the tile's global
        positions (queries, keys), and the (float64, base operand) pairs of the tile's q, dout, k,
        v (k, v: (B, Hkv, c, D))."""
        device, dtype = q.device, self.dtype
        for kpos in self.key_blocks:
            visible = visible_tiles(
                self.mask, self.rows, self.qblocks, kpos, [(0, kpos.numel())], device
            )
            if visible:  # the tile masks are made again each sweep: r x n of them would not fit
                k, v = (kv_heads(load(self.fetch(name, kpos), dtype)) for name in ("k", "v"))
                for a, z, ka, kz, m in visible:
                    yield (
                        a,
                        z,
                        m,
                        (self.rows[a:z], kpos[ka:kz]),
                        *(
                            operands(t, dtype)
                            for t in (
                                q[..., a:z, :],
                                dout[..., a:z, :],
                                k[:, :, ka:kz],
                                v[:, :, ka:kz],
                            )
                        ),
                    )
            # tiles change size at the edges: give glibc's holes back (peak RSS of long shares)
            self.trim(0)


def rows_part(
    fetch: Fetch,
    rows: torch.Tensor,
    key_blocks: Sequence[torch.Tensor],
    heads_kv: int,
    mask: MaskSpec,
    scale: float,
    dtype: torch.dtype,
    size: int,
    exact_scores: bool = False,
    variant: TileVariant = PLAIN,
    store: TileStore | None = None,
) -> tuple[RowsPart, RowsPart]:
    """The rows pass of query rows `rows` (a share's global positions) against every key group
    (`key_blocks`: their positions), float64 and the base in `dtype`. Three sweeps over the key
    blocks some row sees, each block fetched once per sweep: (1) the softmax's max and sum, and the
    float64 out by an online softmax; then the sink, once; (2) the base's out and D (P is
    normalised before it is rounded); (3) dq, and the share's dsinks. `exact_scores`: the base keeps
    its scores in float32 (`ScoreRounding`). `variant`: the score function and the sink. `store`:
    where sweep (3) leaves its tiles for the keys pass of one pass (`TileStore`)."""
    t0 = time.perf_counter()
    sr = ScoreRounding(dtype, exact_scores)
    q, dout = (group_heads(load(fetch(name, rows), dtype), heads_kv) for name in ("q", "dout"))
    b, hkv, g, r, _ = q.shape
    trim = trimmer(b * hkv * g * r * sum(kp.numel() for kp in key_blocks))
    qblocks = runs(rows, size)
    sweep = _RowsSweep(
        fetch, rows, qblocks, key_blocks, mask, scale, dtype, sr, trim, variant, store
    )
    mx, total, mxb, totalb, out, pv = _softmax_sweep(sweep, q, dout)  # (1)
    alpha = variant.fold_sink(mx, total)
    if alpha is not None:  # the sink: a key of logit sink_h and value 0
        out.mul_(alpha.unsqueeze(-1))
        pv.mul_(alpha.unsqueeze(-1))
        variant.fold_sink(mxb, totalb)
    norm, normb = normaliser(mx, total), normaliser(mxb, totalb)
    out.div_(norm[1].unsqueeze(-1))
    pv.div_(norm[1].unsqueeze(-1))
    delta = (dout * out).sum(dim=-1)  # (B, Hkv, g, r)
    amp = (dout.abs() * pv).sum(dim=-1)
    maxima = {"out": amax(pv), "dq_d": amax(amp), "max_q": amax(q), "max_dout": amax(dout)}
    dout_l1 = dout.abs().sum(dim=-1) if variant.sinks is not None else None
    del pv
    outb, deltab = _base_out_sweep(sweep, q, dout, normb)  # (2)
    dq, dqb, ds_rows = _gradient_sweep(sweep, q, dout, norm, normb, delta, deltab)  # (3)
    del q, dout
    exact = _rows_part(rows, out, dq, mx, total, delta, amp, torch.float64)
    exact.maxima = {**maxima, "dq": amax(ds_rows)}
    base = _rows_part(rows, outb, dqb, mxb, totalb, deltab, None, dtype)
    if variant.sinks is not None:
        exact.dsinks, dsb, sink_maxima = sink_grads(
            variant, norm, normb, (delta, deltab, amp, dout_l1), rounder(dtype)
        )
        base.dsinks = dsb.to(dtype)
        exact.maxima.update(sink_maxima)
    del out, dq
    exact.seconds = time.perf_counter() - t0
    return exact, base


def _softmax_sweep(sweep: _RowsSweep, q: torch.Tensor, dout: torch.Tensor) -> tuple:
    """Sweep (1): the rows' max and sum, float64 and base, by an online softmax.

    Also the float64 out and the term scale sum_j p_ij |v_jd|, both not yet normalised. Returns
    (mx, total, base mx, base total, out, pv)."""
    srnd, scale, var = sweep.sr.scores(), sweep.scale, sweep.variant
    b, hkv, g, r, _ = q.shape
    f64 = dict(dtype=torch.float64, device=q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    mx, total = torch.full((b, hkv, g, r), float("-inf"), **f64), torch.zeros((b, hkv, g, r), **f64)
    mxb, totalb = (
        torch.full((b, hkv, g, r), float("-inf"), **f32),
        torch.zeros((b, hkv, g, r), **f32),
    )
    out = torch.zeros_like(dout, dtype=torch.float64)  # v's head dim
    pv = torch.zeros_like(out)  # the term scale sum_j p_ij |v_jd|
    for a, z, m, pos, (qt, qlo), _, (kt, klo), (vt, _) in sweep.tiles(q, dout):
        base = var.base(sweep.sr.qk(qlo, keys_t(klo)), srnd, scale, m, pos)
        exact = var.exact(torch.matmul(qt, keys_t(kt)), scale, m, pos)
        if sweep.store is not None:  # kept for sweeps (2) and (3)
            sweep.store.put("base", pos, base, copy=True)
            sweep.store.put("exact", pos, exact, copy=True)
        online(mxb, totalb, base[0], a, z)
        p, alpha = online(mx, total, exact[0], a, z)
        out[..., a:z, :] = out[..., a:z, :] * alpha.unsqueeze(-1) + torch.matmul(p, vt.unsqueeze(2))
        pv[..., a:z, :] = pv[..., a:z, :] * alpha.unsqueeze(-1) + torch.matmul(
            p, vt.abs().unsqueeze(2)
        )
        del p
    return mx, total, mxb, totalb, out, pv


def _base_out_sweep(
    sweep: _RowsSweep, q: torch.Tensor, dout: torch.Tensor, normb: Norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sweep (2): the base's out, rounded, and its D = sum_j P_ij dP_ij."""
    dtype, sr = sweep.dtype, sweep.sr
    rnd, srnd = rounder(dtype), sr.scores()
    b, hkv, g, r, _ = q.shape
    outb = torch.zeros_like(dout, dtype=torch.float32)
    deltab = torch.zeros((b, hkv, g, r), dtype=torch.float32, device=q.device)
    for a, z, m, pos, (_, qlo), (_, dlo), (_, klo), (vt, vlo) in sweep.tiles(q, dout):
        scores, _ = _kept(sweep, "base", pos, True) or sweep.variant.base(
            sr.qk(qlo, keys_t(klo)), srnd, sweep.scale, m, pos
        )
        p = rnd(probs(scores, norm_rows(normb, a, z)))
        outb[..., a:z, :] += torch.matmul(p, vt.float().unsqueeze(2))
        dp = lo_matmul(dtype, dlo, keys_t(vlo))
        if sweep.store is not None:  # kept for sweep (3)
            sweep.store.put("dp", pos, (dp,))
        deltab[..., a:z] += p.mul_(dp).sum(dim=-1)
        del p, dp
    return rnd(outb), deltab


def _gradient_sweep(
    sweep: _RowsSweep,
    q: torch.Tensor,
    dout: torch.Tensor,
    norm: Norm,
    normb: Norm,
    delta: torch.Tensor,
    deltab: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sweep (3): dq, float64 and base, and the rows' sums of |dS c| (the term scale of dq)."""
    dtype, sr, scale, var = sweep.dtype, sweep.sr, sweep.scale, sweep.variant
    rnd, srnd = rounder(dtype), sr.scores()
    b, hkv, g, r, _ = q.shape
    dq, dqb = torch.zeros_like(q), torch.zeros_like(q, dtype=torch.float32)
    ds_rows = torch.zeros((b, hkv, g, r), dtype=torch.float64, device=q.device)
    for a, z, m, pos, (qt, qlo), (dt, dlo), (kt, klo), (vt, vlo) in sweep.tiles(q, dout):
        sb, tb = _kept(sweep, "base", pos) or var.base(sr.qk(qlo, keys_t(klo)), srnd, scale, m, pos)
        (dpb,) = _kept(sweep, "dp", pos) or (lo_matmul(dtype, dlo, keys_t(vlo)),)
        pb, drawb = var.base_backward(
            sb,
            tb,
            dpb,
            rnd,
            norm_rows(normb, a, z),
            deltab[..., a:z],
            scale,
            srnd,
        )
        dqb[..., a:z, :] += torch.matmul(drawb, kt.float().unsqueeze(2))
        exact = _kept(sweep, "exact", pos) or var.exact(torch.matmul(qt, keys_t(kt)), scale, m, pos)
        p, ds, draw = var.backward_of(
            exact, torch.matmul(dt, keys_t(vt)), scale, norm_rows(norm, a, z), delta[..., a:z]
        )
        dq[..., a:z, :] += torch.matmul(draw, kt.unsqueeze(2))
        ds_rows[..., a:z] += ds.abs_().sum(dim=-1)
        if sweep.store is not None:
            sweep.store.put("grad", pos, (pb, drawb, p, ds, draw))
        del p, ds, draw, pb, drawb
    return dq, dqb, ds_rows


def _kept(sweep: _RowsSweep, kind: str, pos, again: bool = False) -> tuple | None:
    """A tile an earlier sweep kept (`TileStore`), or None: form it again."""
    return None if sweep.store is None else sweep.store.take(kind, pos, again)


def _rows_part(
    rows: torch.Tensor,
    out: torch.Tensor,
    dq: torch.Tensor,
    mx: torch.Tensor,
    total: torch.Tensor,
    delta: torch.Tensor,
    amp: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> RowsPart:
    """A rows pass's result from its (B, Hkv, g, r) tensors: lse from the max and sum, every tensor
    in the token layout."""
    b, hkv, g, r, _ = out.shape
    hq = hkv * g
    lse = torch.where(total > 0, mx + total.log(), torch.full_like(mx, float("-inf")))
    return RowsPart(
        rows,
        ungroup_heads(out).to(out_dtype),
        lse.reshape(b, hq, r),
        ungroup_heads(dq).to(out_dtype),
        *(t.reshape(b, hq, r) if t is not None else None for t in (mx, total, delta, amp)),
    )
