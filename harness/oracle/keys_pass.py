"""The oracle's keys pass over one share: every query against its keys.

`keys_part` gives dk and dv of the share's keys and, in float64, the term scales' column sums,
given every row's statistics from the rows passes. It computes each tile as the rows pass does,
float64 and the same-dtype base side by side. docs/oracle.md has the derivation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from harness.oracle.numerics import (
    Norm,
    ScoreRounding,
    amax,
    group_heads,
    keys_side,
    keys_t,
    kv_heads,
    lo_matmul,
    load,
    masked,
    normaliser,
    operands,
    rounder,
)
from harness.oracle.parts import Fetch, KeysPart, RowStats
from harness.oracle.tile_store import TileStore
from harness.oracle.tiles import Group, trimmer, visible_tiles
from harness.oracle.variant import PLAIN, TileVariant
from ring_impl.masks import MaskSpec


@dataclass
class _KeysSweep:
    """What every tile of a keys pass reads: the share's k and v, every row's statistics, and the
    rounding. `others` keeps the k and v of key groups that hold other shares' keys."""

    fetch: Fetch
    share: int
    k: torch.Tensor  # (B, Hkv, c, D)
    v: torch.Tensor  # (B, Hkv, c, Dv)
    stats: RowStats  # float64
    stats_base: RowStats
    norm: Norm  # every row's float64 normaliser
    norm_base: Norm
    scale: float
    dtype: torch.dtype
    sr: ScoreRounding
    variant: TileVariant = PLAIN
    others: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    store: TileStore | None = None  # one pass: the rows pass's tiles

    def group_kv(self, i: int, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        """Key group `i`'s k and v (one tile side): a slice of the share's own, or fetched once."""
        c0, c1, o0 = g.own[self.share]
        if c0 == 0 and c1 == g.pos.numel():  # the whole group is this share's
            return self.k[:, :, o0 : o0 + c1], self.v[:, :, o0 : o0 + c1]
        if i not in self.others:
            self.others[i] = tuple(
                kv_heads(load(self.fetch(name, g.pos), self.dtype)) for name in ("k", "v")
            )
        return self.others[i]


@dataclass
class _KeysSums:
    """What a keys pass sums over its tiles: dk and dv, float64 and base, and the column sums."""

    dk: torch.Tensor  # (B, Hkv, c, D)
    dv: torch.Tensor
    dkb: torch.Tensor  # float32
    dvb: torch.Tensor
    cols: dict[str, torch.Tensor]  # ds, pa, p: (B, Hkv, c) float64


def keys_part(
    fetch: Fetch,
    keys: torch.Tensor,
    share: int,
    query_blocks: Sequence[torch.Tensor],
    key_groups: Sequence[Group],
    heads_kv: int,
    stats: Sequence[RowStats],
    mask: MaskSpec,
    scale: float,
    dtype: torch.dtype,
    exact_scores: bool = False,
    variant: TileVariant = PLAIN,
    store: TileStore | None = None,
) -> tuple[KeysPart, KeysPart]:
    """The keys pass of share `share` against every query, float64 and the base in `dtype`.

    `keys` are the share's global positions. `query_blocks` are every share's query blocks
    (`blocks`), and `stats` every row's (float64, base) statistics, by global position. Each tile of
    a query block against a key group holding some of its keys is computed as the rows pass
    computes it (`Group`). One sweep over the query blocks that see some of its keys, each fetched
    once. `exact_scores` and `variant`: as in `rows_part`. The sink needs nothing here: it is in
    every row's statistics."""
    t0 = time.perf_counter()
    sweep = _keys_sweep(fetch, keys, share, stats, scale, dtype, exact_scores, variant, store)
    k, v = sweep.k, sweep.v
    b, hkv, c, d = k.shape
    n = sum(qp.numel() for qp in query_blocks)
    trim = trimmer(b * stats[0].mx.shape[1] * n * c)  # batch x query heads x queries x keys
    sums = _KeysSums(
        torch.zeros_like(k),
        torch.zeros_like(v),
        torch.zeros_like(k, dtype=torch.float32),
        torch.zeros_like(v, dtype=torch.float32),
        {
            name: torch.zeros(b, hkv, c, dtype=torch.float64, device=k.device)
            for name in ("ds", "pa", "p")
        },
    )
    mine = list(enumerate(g for g in key_groups if share in g.own))
    for qpos in query_blocks:
        work = _share_tiles(mask, qpos, mine, share, k.device)
        if not work:
            continue
        q, dout = (group_heads(load(fetch(name, qpos), dtype), hkv) for name in ("q", "dout"))
        for tile in work:
            _keys_tile(sweep, sums, qpos, q, dout, tile)
        trim(0)
    rnd = rounder(dtype)
    exact = _keys_part(keys, sums.dk, sums.dv, torch.float64, sums.cols, amax(k), amax(v))
    base = _keys_part(keys, rnd(sums.dkb), rnd(sums.dvb), dtype, {}, 0.0, 0.0)
    exact.seconds = time.perf_counter() - t0
    return exact, base


def _keys_sweep(
    fetch: Fetch,
    keys: torch.Tensor,
    share: int,
    stats: Sequence[RowStats],
    scale: float,
    dtype: torch.dtype,
    exact_scores: bool,
    variant: TileVariant,
    store: TileStore | None,
) -> _KeysSweep:
    """A keys pass's inputs: the share's k and v, fetched, and every row's statistics moved to
    their device."""
    k, v = (kv_heads(load(fetch(name, keys), dtype)) for name in ("k", "v"))
    st, stb = (s.to(k.device) for s in stats)
    norm, normb = normaliser(st.mx, st.total), normaliser(stb.mx, stb.total)
    sr = ScoreRounding(dtype, exact_scores)
    return _KeysSweep(
        fetch, share, k, v, st, stb, norm, normb, scale, dtype, sr, variant, store=store
    )


def _tile_rows(t: torch.Tensor, at: torch.Tensor, b: int, hkv: int) -> torch.Tensor:
    """The rows `at` (global positions) of a (B, Hq, N) statistic, grouped as (B, Hkv, g, q)."""
    return t.index_select(-1, at).view(b, hkv, -1, at.numel())


# (group index, group, qa, qz, ka, kz, mask, u0, u1, o): one tile of a share's keys pass
Work = tuple


def _keys_tile(
    sweep: _KeysSweep,
    sums: _KeysSums,
    qpos: torch.Tensor,
    q: torch.Tensor,
    dout: torch.Tensor,
    tile: Work,
) -> None:
    """Add one tile to the keys pass's sums: the base's dk and dv, then float64's and the column
    sums. The tile is the rows pass's tile, whole; only this share's columns u0:u1 are kept. In
    one pass the rows pass may have kept the tile (`TileStore`): it is used as it is."""
    i, g, qa, qz, ka, kz, m, u0, u1, o = tile
    b, hkv, _, d = sweep.k.shape
    at = qpos[qa:qz].to(sweep.k.device)
    qt, dt = (operands(t, sweep.dtype) for t in (q[..., qa:qz, :], dout[..., qa:qz, :]))
    kept = None
    if sweep.store is not None and u0 == 0 and u1 == kz - ka:
        kept = sweep.store.take("grad", (at, g.pos[ka:kz]))
    pb, drawb, p, ds, draw = kept or _form_tile(sweep, qt, dt, at, tile)
    w = u1 - u0
    rows_q = qt[0].reshape(b, hkv, -1, d)  # (B, Hkv, g q, D)
    rows_dout = dt[0].reshape(b, hkv, -1, dt[0].shape[-1])
    sums.dkb[:, :, o : o + w] += torch.matmul(keys_side(drawb), rows_q.float())
    sums.dvb[:, :, o : o + w] += torch.matmul(keys_side(pb), rows_dout.float())
    del pb, drawb
    sums.dk[:, :, o : o + w] += torch.matmul(keys_side(draw), rows_q)
    sums.dv[:, :, o : o + w] += torch.matmul(keys_side(p), rows_dout)
    cols = sums.cols
    cols["ds"][..., o : o + w] += ds.sum(dim=(2, 3))
    cols["p"][..., o : o + w] += p.sum(dim=(2, 3))
    cols["pa"][..., o : o + w] += p.mul_(_tile_rows(sweep.stats.amp, at, b, hkv).unsqueeze(-1)).sum(
        dim=(2, 3)
    )


def _form_tile(sweep: _KeysSweep, qt: tuple, dt: tuple, at: torch.Tensor, tile: Work) -> tuple:
    """A tile's (base P, base s dS, float64 P, |dS|, s dS) on this share's columns u0:u1, formed
    as the rows pass forms them. `qt`, `dt`: the tile's (float64, base operand) q and dout."""
    i, g, qa, qz, ka, kz, m, u0, u1, o = tile
    k, v, dtype, scale = sweep.k, sweep.v, sweep.dtype, sweep.scale
    b, hkv = k.shape[:2]
    kg, vg = sweep.group_kv(i, g)
    (_, klo), (_, vlo) = (operands(t, dtype) for t in (kg[:, :, ka:kz], vg[:, :, ka:kz]))
    mo = None if m is None else m[:, u0:u1]
    if mo is not None and bool(mo.all()):
        mo = None
    kt, vt = k[:, :, o : o + u1 - u0], v[:, :, o : o + u1 - u0]
    sb, tb = _base_scores(sweep, qt[1], klo, mo, (at, g.pos[ka:kz]), (u0, u1))
    dp = lo_matmul(dtype, dt[1], keys_t(vlo))[..., u0:u1]
    pb, drawb = sweep.variant.base_backward(
        sb,
        tb,
        dp,
        rounder(dtype),
        tuple(_tile_rows(t, at, b, hkv) for t in sweep.norm_base),
        _tile_rows(sweep.stats_base.delta, at, b, hkv),
        scale,
        sweep.sr.scores(),
    )
    p, ds, draw = sweep.variant.backward(
        torch.matmul(qt[0], keys_t(kt)),
        torch.matmul(dt[0], keys_t(vt)),
        mo,
        scale,
        tuple(_tile_rows(t, at, b, hkv) for t in sweep.norm),
        _tile_rows(sweep.stats.delta, at, b, hkv),
        (at, g.pos[ka + u0 : ka + u1]),
    )
    return pb, drawb, p, ds.abs_(), draw


def _base_scores(
    sweep: _KeysSweep, qlo: torch.Tensor, klo: torch.Tensor, mo, pos, cols: tuple[int, int]
):
    """The base's scores and tanh (`TileVariant.base`) of this share's columns of the rows pass's
    tile.

    The tile's q.k is formed whole, as the rows pass forms it. Plain scores are exact per element,
    so they are formed on the columns alone. A variant's are formed on the whole tile, as in the
    rows pass: tanh's vector and scalar paths may differ by an ulp."""
    u0, u1 = cols
    raw = sweep.sr.qk(qlo, keys_t(klo))
    var, srnd = sweep.variant, sweep.sr.scores()
    if var.plain_scores:
        return var.base(raw[..., u0:u1], srnd, sweep.scale, mo, None)
    s, t = var.base(raw, srnd, sweep.scale, None, pos)
    return masked(s[..., u0:u1], mo), None if t is None else t[..., u0:u1]


def _keys_part(
    keys: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    out_dtype: torch.dtype,
    cols: dict[str, torch.Tensor],
    max_k: float,
    max_v: float,
) -> KeysPart:
    """A keys pass's result: dk and dv in the token layout (B, c, Hkv, D), in `out_dtype`."""
    dk, dv = (t.permute(0, 2, 1, 3).contiguous().to(out_dtype) for t in (dk, dv))
    return KeysPart(keys, dk, dv, cols, max_k, max_v)


def _share_tiles(
    mask: MaskSpec, qpos: torch.Tensor, mine: Sequence[tuple[int, Group]], share: int, device
) -> list[Work]:
    """The tiles of query block `qpos` against the key groups holding some of `share`'s keys.

    Each tile keeps its columns u0:u1 that are the share's keys o:o + u1 - u0."""
    work = []
    for i, g in mine:
        c0, c1, o0 = g.own[share]
        for qa, qz, ka, kz, m in visible_tiles(
            mask, qpos, [(0, qpos.numel())], g.pos, [(0, g.pos.numel())], device
        ):
            lo, hi = max(ka, c0), min(kz, c1)
            if lo < hi:  # the tile holds some of this share's keys: columns lo:hi
                work.append((i, g, qa, qz, ka, kz, m, lo - ka, hi - ka, o0 + lo - c0))
    return work
