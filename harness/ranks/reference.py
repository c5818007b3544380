"""The oracle's share of one rank: float64 reference and same-dtype base, split by query rows and by keys.

The oracle is partitioned by the case, never by who computes it. Share `g` of a W-rank case is the global
positions rank g holds under the case's layout, P_g, and it is computed in two passes, float64 and the base side
by side, in tiles of at most `block(case)` queries x `block(case)` keys (at most SCORE_BUDGET score entries): a
block of one share's queries (`_runs`: its contiguous runs of positions tiled on their own) against a key group
(`Group`: consecutive blocks of the shares' positions), trimmed to the rows and keys its mask lets meet, so
that no pass ever holds a global tensor of head_dim width:

1. rows (`rows_part`): the queries P_g against every key: out, lse and dq of those rows, and the per-row
   statistics the keys pass needs: the softmax's row max and sum, D (below) and (float64) A, the term scale
   of D. Three sweeps over the key blocks, each key block generated from the case seed once per sweep
   (`harness.inputs` makes any positions): max and sum (online), out and D, dq.
2. keys (`keys_part`): every query against the keys P_g: dk and dv of those keys, and (float64) the term
   scales' column sums. The query blocks are generated from the seed one at a time; their statistics come from
   the rows pass of every share (`RowStats`, gathered by whoever runs the passes: B x Hq floats per token).

Per share the memory is the share's own rows and keys (~N/W tokens x heads x head_dim), one tile's workspace
and one block of generated inputs (a small case makes each whole input once: WHOLE_INPUTS_BYTES), plus the
B x Hq x N row statistics (no head_dim factor): it falls ~1/W (`ring-harness bench --only oracle_split`, (d)).

The ranks compute their own share on their own device (pool workers: one CPU thread each; torchrun:
cuda:LOCAL_RANK) after the implementation's run, outside the fault interposer; `harness.judging.oracle`
runs the passes (one message each), gathers the statistics between them and assembles the parts in one
place. The local oracle (`--oracle local`, the tests' referee) runs the same parts one after another in
one process with the same blocks, so on CPU the two are bit-identical by construction.

The float64 reference's backward is the hand-written one (dP = dO V^T, D = rowsum(dO * O), dS = P (dP - D),
dQ = s dS K, dK = s dS^T Q, dV = P^T dO), sharing P, dP and dS with the term scales. The base is plain
attention as autograd computes it in the case's dtype (the tolerance's `base` term measures its roundings,
docs/tolerance.md), op by op: scores q.k and s q.k, the softmax P = exp(s - max) / sum (float32), dP, the
softmax's backward dS = P (dP - D) with D = sum_j P_ij dP_ij (float32, from the rounded P and dP: autograd's
softmax backward, not flash's rowsum(dO * O)) and s dS, each rounded to the dtype as it is formed; every matmul
sums products of dtype values in float32 (across tiles too) and rounds its result once: q.k, dP, out, dq, dk, dv
(dk/dv summed over a GQA group in float32). Both passes recompute q.k and dP, each tile with the same operands,
shapes and layout (the keys pass computes the rows pass's tile whole and keeps its own columns), so they round
alike. Split into tiles it rounds where one autograd graph over the whole sequence does. A query that sees no
key gets out = 0, lse = -inf, dq = 0 and contributes nothing to dk/dv (never NaN).
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from harness import inputs
from harness.case import Case
from harness.dtypes import TORCH_DTYPES
from harness.inputs import FLASH_BASE_VALUES
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec, allowed

SCORE_BUDGET = 1 << 21  # score entries (batch x query heads x queries x keys) of one tile: 16 MiB float64
MAX_BLOCK = 1024
MIN_BLOCK = 16

Fetch = Callable[[str, torch.Tensor], torch.Tensor]  # (q/k/v/dout, global positions) -> (B, len, heads, D)


def _libc_trim():
    """glibc's malloc_trim, or a no-op elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda pad: 0


_TRIM = _libc_trim()


def _trimmer(entries: int) -> Callable[[int], int]:
    """glibc's malloc_trim for work of more than one tile's score entries (a long share: its tiles change size at
    the edges and glibc keeps the holes, 1.15 GiB instead of 0.5 GiB peak RSS for a 16k share once), a no-op for
    the rest: a trim walks the whole heap (26 ms in a process holding ~800 MB of small blocks, e.g. a test
    runner), more than a small case's whole oracle."""
    return _TRIM if entries > SCORE_BUDGET else (lambda pad: 0)


def block_size(batch: int, heads_q: int) -> int:
    """Queries (and keys) per tile side: the square tile of at most SCORE_BUDGET score entries (a few float64
    temporaries of that size live at once), between MIN_BLOCK and MAX_BLOCK."""
    return max(MIN_BLOCK, min(MAX_BLOCK, math.isqrt(SCORE_BUDGET // max(1, batch * heads_q))))


def block(case: Case) -> int:
    """The case's tile side: a function of the case only, so every way of computing the oracle uses the same
    tiles."""
    return block_size(case.batch, case.heads_q)


@dataclass
class RowStats:
    """What the keys pass needs of every query row, one compute dtype, (B, Hq, N): the softmax's row max and sum
    of exp(s - max), D (float64: rowsum(dout * out); the base: sum_j P_ij dP_ij) and (float64 only) A, the term
    scale of D (`TermScales`)."""

    mx: torch.Tensor
    total: torch.Tensor
    delta: torch.Tensor
    amp: torch.Tensor | None = None

    def to(self, device) -> RowStats:
        return RowStats(*(None if t is None else t.to(device) for t in (self.mx, self.total, self.delta, self.amp)))


@dataclass
class RowsPart:
    """The rows pass of one share, one compute dtype: its query rows' out/lse/dq, their statistics (`RowStats`),
    and (float64 only) the row maxima of the term scales: out, dq, dq_d, max_q, max_dout."""

    rows: torch.Tensor  # (r,) global query positions, in the order of the rows below
    out: torch.Tensor  # (B, r, Hq, D) in the compute dtype
    lse: torch.Tensor  # (B, Hq, r) float64 / float32
    dq: torch.Tensor  # (B, r, Hq, D)
    mx: torch.Tensor  # (B, Hq, r) in the accumulation dtype: the rows' score max (-inf: sees no key)
    total: torch.Tensor  # (B, Hq, r): sum_j exp(s_ij - mx_i)
    delta: torch.Tensor  # (B, Hq, r)
    amp: torch.Tensor | None = None  # (B, Hq, r) float64
    maxima: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def cpu(self) -> RowsPart:
        for name in ("rows", "out", "lse", "dq", "mx", "total", "delta", "amp"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).cpu())
        return self


@dataclass
class KeysPart:
    """The keys pass of one share, one compute dtype: its keys' dk/dv from every query and (float64 only) the
    term scales' column sums over every query (ds, pa, p: (B, Hkv, c)), max|k| and max|v|."""

    keys: torch.Tensor  # (c,) global key positions
    dk: torch.Tensor  # (B, c, Hkv, D) in the compute dtype
    dv: torch.Tensor
    cols: dict[str, torch.Tensor] = field(default_factory=dict)
    max_k: float = 0.0
    max_v: float = 0.0
    seconds: float = 0.0

    def cpu(self) -> KeysPart:
        self.keys, self.dk, self.dv = self.keys.cpu(), self.dk.cpu(), self.dv.cpu()
        self.cols = {n: t.cpu() for n, t in self.cols.items()}
        return self


def _blocks(n: int, size: int):
    return ((a, min(n, a + size)) for a in range(0, n, size))


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _rounder(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Round float32 values to `dtype`, kept in float32 (identity for float32)."""
    if dtype == torch.float32:
        return lambda t: t
    return lambda t: t.to(dtype).to(torch.float32)


def _load(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inputs rounded to the case's dtype, held in float64 (exact)."""
    return t.detach().to(dtype).to(torch.float64)


def _heads(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """Queries (B, r, Hq, D) -> (B, Hkv, g, r, D), contiguous: query head h belongs to kv head h // g."""
    b, r, hq, d = t.shape
    return t.reshape(b, r, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4).contiguous()


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, g, r, D) -> (B, r, Hq, D)."""
    b, hkv, g, r, d = t.shape
    return t.permute(0, 3, 1, 2, 4).reshape(b, r, hkv * g, d)


def _kv_heads(t: torch.Tensor) -> torch.Tensor:
    """Keys (B, c, Hkv, D) -> (B, Hkv, c, D), contiguous."""
    return t.permute(0, 2, 1, 3).contiguous()


def _t(k: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, c, D) -> (B, Hkv, 1, D, c): the right operand of a score matmul, broadcast over the group."""
    return k.unsqueeze(2).transpose(-1, -2)


def _keys_side(t: torch.Tensor) -> torch.Tensor:
    """A tile (B, Hkv, g, q, k) as (B, Hkv, k, g q): the left operand of a key gradient, summing the group's
    query heads inside the one matmul."""
    b, hkv, g, r, c = t.shape
    return t.permute(0, 1, 4, 2, 3).reshape(b, hkv, c, g * r)


def _runs(pos: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """Index ranges of at most `size` tiling a share's positions: each contiguous run of positions tiled on its
    own when the runs are long enough for tiles of their own (MIN_BLOCK on average: zigzag's two chunks, a
    contiguous shard), so a mask's span over a tile's positions stays tight; else plain blocks (striped)."""
    n = pos.numel()
    breaks = ((pos[1:] != pos[:-1] + 1).nonzero().view(-1) + 1).tolist() if n > 1 else []
    if n == 0:
        return []
    if n < MIN_BLOCK * (len(breaks) + 1):
        return _even(0, n, size)
    edges = [0, *breaks, n]
    return [t for a, b in zip(edges[:-1], edges[1:], strict=True) for t in _even(a, b, size)]


def _even(a: int, b: int, size: int) -> list[tuple[int, int]]:
    """a:b cut into the fewest blocks of at most `size`, of equal length within one (1024 at 724: 512 + 512, not
    724 + 300: the matmuls of a ragged last block are slower for their size)."""
    count = -(-(b - a) // size)
    step, extra = divmod(b - a, count)
    edges = [a + i * step + min(i, extra) for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


Tile = tuple  # (qa, qz, ka, kz, mask or None): queries qa:qz x keys ka:kz of a block pair, trimmed to what is seen


def _tiles(mask: MaskSpec, qpos: torch.Tensor, qblocks, kpos: torch.Tensor, kblocks, device) -> list[Tile]:
    """Every (query block, key block) pair in which some query sees some key, each trimmed to the rows that see
    some key of the block and the keys some row sees (causal, window and document masks leave much of a block
    pair out), with its mask (None when every query of the tile sees every key)."""
    out = []
    for qa, qz in qblocks:
        for ka, kz in kblocks:
            m = allowed(mask, qpos[qa:qz], kpos[ka:kz])
            if m is None:
                out.append((qa, qz, ka, kz, None))
                continue
            rows, cols = m.any(dim=1).nonzero().view(-1), m.any(dim=0).nonzero().view(-1)
            if rows.numel() == 0:
                continue
            r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
            m = m[r0:r1, c0:c1]
            out.append((qa + r0, qa + r1, ka + c0, ka + c1, None if bool(m.all()) else m.to(device)))
    return out


@dataclass(frozen=True)
class Group:
    """A canonical key group: consecutive blocks of the shares' positions (each share's `_runs` blocks, shares in
    order), at most one tile side together (one block when the blocks are that long). The rows pass tiles its
    queries against each group whole; the keys pass of share h computes the same tile, whole, and keeps its own
    columns, `own[h]`, so both passes form each of the base's products with the same operands."""

    pos: torch.Tensor  # the group's global positions
    own: dict  # share -> (first column, end column, first index into the share's positions)


def groups(shares: Sequence[torch.Tensor], size: int) -> list[Group]:
    """The canonical key groups of shares with these positions (every share's, in order) and tile side."""
    out, cur = [], []

    def flush() -> None:
        own, width = {}, 0
        for h, a, z in cur:
            c0, _, o0 = own.get(h, (width, 0, a))
            own[h] = (c0, width + z - a, o0)
            width += z - a
        out.append(Group(torch.cat([shares[h][a:z] for h, a, z in cur]), own))
        cur.clear()

    for h, pos in enumerate(shares):
        for a, z in _runs(pos, size):
            if cur and sum(y - x for _, x, y in cur) + z - a > size:
                flush()
            cur.append((h, a, z))
    if cur:
        flush()
    return out


def _masked(s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    return s if m is None else s.masked_fill_(~m, float("-inf"))


def _lo_matmul(dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The base's q.k or dout.v: a matmul of dtype values (`a`, `b` contiguous, in the dtype for bf16, else
    float32), summed in float32 as a dtype kernel does and rounded to the dtype once; float32 out. Both passes
    compute each tile (a query block against a key group, `Group`) with the same operands, shapes and layout, so
    its rounding is the same in both: a kernel's summation order can follow the shape (0.6% of an fp32 test's
    scores differed by an ulp between tile shapes, and at |s| ~ 350 an fp32 base's dv then erred 60x autograd's:
    every P of the keys pass off by 350 ulps against the rows pass's normaliser)."""
    c = torch.matmul(a, b)
    if dtype == torch.bfloat16:
        return c.float()
    return c if dtype == torch.float32 else c.to(dtype).float()  # fp16: CPU fp16 matmuls are ~15x slower


def _operands(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64, the base's matmul operand) of a tile's inputs, contiguous (a canonical layout for `_lo_matmul`)."""
    t = t.contiguous()
    return t, t.to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


def _base_scores(raw: torch.Tensor, rnd, scale: float, m) -> torch.Tensor:
    """The base's scaled scores from its q.k (already rounded to the dtype): times the scale, rounded again."""
    return _masked(rnd(raw.mul_(scale)), m)


Norm = tuple  # (shift, denominator) of every row of a tile: (B, Hkv, g, q) each (`_norm`)


def _norm(mx: torch.Tensor, total: torch.Tensor) -> Norm:
    """A softmax's normalisation from the row max of the scores and the sum of exp(s - max): (max, sum), or
    (+inf, 1) for a row that sees no key (its p is then exp(-inf) = 0, never NaN)."""
    empty = total <= 0
    return (torch.where(empty, torch.full_like(mx, float("inf")), mx),
            torch.where(empty, torch.ones_like(total), total))


def _rows(norm: Norm, a: int, z: int) -> Norm:
    return norm[0][..., a:z], norm[1][..., a:z]


def _probs(s: torch.Tensor, norm: Norm) -> torch.Tensor:
    """p = exp(s - max) / sum in place, as a softmax forms it (exp(s - lse) would err by eps |lse| in float32)."""
    shift, denom = norm
    return s.sub_(shift.unsqueeze(-1)).exp_().div_(denom.unsqueeze(-1))


def _online(mx: torch.Tensor, total: torch.Tensor, s: torch.Tensor, a: int, z: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a tile's scores into rows a:z's running max and sum of exp(s - max): (exp(s - new max) in place of s,
    the factor the rows' earlier partial sums are rescaled by)."""
    new = torch.maximum(mx[..., a:z], s.amax(dim=-1))
    shift = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    alpha = (mx[..., a:z] - shift).exp_()
    p = s.sub_(shift.unsqueeze(-1)).exp_()
    total[..., a:z] = total[..., a:z] * alpha + p.sum(-1)
    mx[..., a:z] = new
    return p, alpha


def _backward(raw: torch.Tensor, dpr: torch.Tensor, m, scale: float, norm: Norm, delta: torch.Tensor):
    """(p, dS, s dS) of a float64 tile from q.k and dP = dout.v (both consumed): dS = p (dP - D)."""
    p = _probs(_masked(raw.mul_(scale), m), norm)
    ds = dpr.sub_(delta.unsqueeze(-1)).mul_(p)
    return p, ds, ds * scale


def _base_backward(raw: torch.Tensor, dp: torch.Tensor, rnd, m, scale: float, norm: Norm, delta: torch.Tensor,
                   srnd=None):
    """(p, s dS) of the base's tile from its q.k and dP = dout.v (`_lo_matmul`, both consumed): P, dS = P (dP - D)
    and s dS each rounded to the dtype as formed; the scores by `srnd` (default `rnd`: `ScoreRounding`)."""
    p = rnd(_probs(_base_scores(raw, srnd or rnd, scale, m), norm))
    ds = rnd(dp.sub_(delta.unsqueeze(-1)).mul_(p))
    return p, rnd(ds.mul_(scale))


@dataclass(frozen=True)
class ScoreRounding:
    """How the base forms its scores: q.k and the scaled scores rounded to the dtype, as plain attention does;
    or, for values on which plain attention overflows (`harness.inputs.FLASH_BASE_VALUES`), kept in float32 as
    flash kernels keep them."""

    dtype: torch.dtype
    exact: bool = False

    def qk(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a.float(), b.float()) if self.exact else _lo_matmul(self.dtype, a, b)

    def scores(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return _rounder(torch.float32 if self.exact else self.dtype)


def rows_part(fetch: Fetch, rows: torch.Tensor, key_blocks: Sequence[torch.Tensor], heads_kv: int, mask: MaskSpec,
              scale: float, dtype: torch.dtype, size: int, exact_scores: bool = False) -> tuple[RowsPart, RowsPart]:
    """The rows pass for query rows `rows` (global positions, a share's, in blocks of `_runs`) against every key
    (`key_blocks`: the positions of the key groups, `Group`), float64 and the base in `dtype` side by side, in
    tiles trimmed to what the mask lets meet (`_tiles`):
    three sweeps over the key blocks some row sees, each block fetched once per sweep: (1) the softmax's max and
    sum, and the float64 out by an online softmax; (2) the base's out and D (its P must be normalised before it
    is rounded); (3) dq. `exact_scores`: the base keeps its scores in float32 (`ScoreRounding`)."""
    t0 = time.perf_counter()
    rnd = _rounder(dtype)
    sr = ScoreRounding(dtype, exact_scores)
    srnd = sr.scores()
    q, dout = (_heads(_load(fetch(name, rows), dtype), heads_kv) for name in ("q", "dout"))
    b, hkv, g, r, d = q.shape
    device = q.device
    qblocks = _runs(rows, size)
    trim = _trimmer(b * hkv * g * r * sum(kp.numel() for kp in key_blocks))

    def sweep(q: torch.Tensor, dout: torch.Tensor):
        """Every tile in which some query sees some key: queries a:z, mask, and (float64, base operand) pairs of
        q, dout, k, v of the tile (k, v (B, Hkv, c, D))."""
        for kpos in key_blocks:
            tiles = _tiles(mask, rows, qblocks, kpos, [(0, kpos.numel())], device)
            if tiles:  # the tile masks are made again each sweep: r x n of them would not fit
                k, v = (_kv_heads(_load(fetch(name, kpos), dtype)) for name in ("k", "v"))
                for a, z, ka, kz, m in tiles:
                    yield a, z, m, *(_operands(t, dtype) for t in (q[..., a:z, :], dout[..., a:z, :],
                                                                  k[:, :, ka:kz], v[:, :, ka:kz]))
            trim(0)  # tiles change size at the edges: give glibc's holes back (peak RSS of long shares)

    f64, f32 = dict(dtype=torch.float64, device=device), dict(dtype=torch.float32, device=device)
    mx, total = torch.full((b, hkv, g, r), float("-inf"), **f64), torch.zeros((b, hkv, g, r), **f64)
    mxb, totalb = torch.full((b, hkv, g, r), float("-inf"), **f32), torch.zeros((b, hkv, g, r), **f32)
    out, outb = torch.zeros_like(q), torch.zeros_like(q, dtype=torch.float32)
    pv = torch.zeros_like(q)  # the term scale sum_j p_ij |v_jd|
    for a, z, m, (qt, qlo), _, (kt, klo), (vt, _) in sweep(q, dout):  # (1)
        _online(mxb, totalb, _base_scores(sr.qk(qlo, _t(klo)), srnd, scale, m), a, z)
        p, alpha = _online(mx, total, _masked(torch.matmul(qt, _t(kt)).mul_(scale), m), a, z)
        out[..., a:z, :] = out[..., a:z, :] * alpha.unsqueeze(-1) + torch.matmul(p, vt.unsqueeze(2))
        pv[..., a:z, :] = pv[..., a:z, :] * alpha.unsqueeze(-1) + torch.matmul(p, vt.abs().unsqueeze(2))
        del p
    norm, normb = _norm(mx, total), _norm(mxb, totalb)
    out.div_(norm[1].unsqueeze(-1))
    pv.div_(norm[1].unsqueeze(-1))
    delta = (dout * out).sum(dim=-1)  # (B, Hkv, g, r)
    amp = (dout.abs() * pv).sum(dim=-1)
    maxima = {"out": _amax(pv), "dq_d": _amax(amp), "max_q": _amax(q), "max_dout": _amax(dout)}
    del pv
    deltab = torch.zeros((b, hkv, g, r), **f32)
    for a, z, m, (_, qlo), (_, dlo), (_, klo), (vt, vlo) in sweep(q, dout):  # (2)
        p = rnd(_probs(_base_scores(sr.qk(qlo, _t(klo)), srnd, scale, m), _rows(normb, a, z)))
        outb[..., a:z, :] += torch.matmul(p, vt.float().unsqueeze(2))
        deltab[..., a:z] += p.mul_(_lo_matmul(dtype, dlo, _t(vlo))).sum(dim=-1)
        del p
    outb = rnd(outb)
    dq, dqb = torch.zeros_like(q), torch.zeros_like(q, dtype=torch.float32)
    ds_rows = torch.zeros((b, hkv, g, r), **f64)
    for a, z, m, (qt, qlo), (dt, dlo), (kt, klo), (vt, vlo) in sweep(q, dout):  # (3)
        _, drawb = _base_backward(sr.qk(qlo, _t(klo)), _lo_matmul(dtype, dlo, _t(vlo)), rnd, m, scale,
                                  _rows(normb, a, z), deltab[..., a:z], srnd)
        dqb[..., a:z, :] += torch.matmul(drawb, kt.float().unsqueeze(2))
        _, ds, draw = _backward(torch.matmul(qt, _t(kt)), torch.matmul(dt, _t(vt)), m, scale, _rows(norm, a, z),
                                delta[..., a:z])
        dq[..., a:z, :] += torch.matmul(draw, kt.unsqueeze(2))
        ds_rows[..., a:z] += ds.abs_().sum(dim=-1)
        del ds, draw, drawb
    hq = hkv * g

    def part(out, dq, mx, total, delta, amp, out_dtype):
        lse = torch.where(total > 0, mx + total.log(), torch.full_like(mx, float("-inf")))
        return RowsPart(rows, _tokens(out).to(out_dtype), lse.reshape(b, hq, r), _tokens(dq).to(out_dtype),
                        *(t.reshape(b, hq, r) if t is not None else None for t in (mx, total, delta, amp)))

    del q, dout
    ref = part(out, dq, mx, total, delta, amp, torch.float64)
    ref.maxima = {**maxima, "dq": _amax(ds_rows)}
    del out, dq
    base = part(outb, dqb, mxb, totalb, deltab, None, dtype)
    ref.seconds = time.perf_counter() - t0
    return ref, base


def keys_part(fetch: Fetch, keys: torch.Tensor, share: int, query_blocks: Sequence[torch.Tensor],
              key_groups: Sequence[Group], heads_kv: int, stats: Sequence[RowStats], mask: MaskSpec, scale: float,
              dtype: torch.dtype, exact_scores: bool = False) -> tuple[KeysPart, KeysPart]:
    """The keys pass of share `share` (its keys `keys`, global positions) against every query (`query_blocks`:
    every share's query blocks, `blocks`) whose (float64, base) row statistics are `stats` (every row, by global
    position), float64 and the base in `dtype` side by side: each tile of a query block against a key group
    holding some of its keys, computed as the rows pass computes it (`Group`), one sweep over the query blocks
    that see some of its keys, each fetched once. `exact_scores`: as in `rows_part`."""
    t0 = time.perf_counter()
    rnd = _rounder(dtype)
    sr = ScoreRounding(dtype, exact_scores)
    k, v = (_kv_heads(_load(fetch(name, keys), dtype)) for name in ("k", "v"))
    b, hkv, c, d = k.shape
    n = sum(qp.numel() for qp in query_blocks)
    trim = _trimmer(b * stats[0].mx.shape[1] * n * c)  # batch x query heads x queries x keys
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dkb, dvb = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    cols = {name: torch.zeros(b, hkv, c, dtype=torch.float64, device=k.device) for name in ("ds", "pa", "p")}
    st, stb = (s.to(k.device) for s in stats)
    norm_all, normb_all = _norm(st.mx, st.total), _norm(stb.mx, stb.total)
    mine = [g for g in key_groups if share in g.own]
    others: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a group with others' keys: its k, v (one tile side)

    def group_kv(i: int, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        c0, c1, o0 = g.own[share]
        if c0 == 0 and c1 == g.pos.numel():  # the whole group is this share's
            return k[:, :, o0:o0 + c1], v[:, :, o0:o0 + c1]
        if i not in others:
            others[i] = tuple(_kv_heads(_load(fetch(name, g.pos), dtype)) for name in ("k", "v"))
        return others[i]

    for qpos in query_blocks:
        work = []
        for i, g in enumerate(mine):
            c0, c1, o0 = g.own[share]
            for qa, qz, ka, kz, m in _tiles(mask, qpos, [(0, qpos.numel())], g.pos, [(0, g.pos.numel())], k.device):
                lo, hi = max(ka, c0), min(kz, c1)
                if lo < hi:  # the tile holds some of this share's keys: columns lo:hi, keys o:o + hi - lo
                    work.append((i, g, qa, qz, ka, kz, m, lo - ka, hi - ka, o0 + lo - c0))
        if not work:
            continue
        q, dout = (_heads(_load(fetch(name, qpos), dtype), hkv) for name in ("q", "dout"))
        for i, g, qa, qz, ka, kz, m, u0, u1, o in work:
            at = qpos[qa:qz].to(k.device)

            def rows_of(t: torch.Tensor) -> torch.Tensor:  # the tile's rows of a (B, Hq, N) statistic
                return t.index_select(-1, at).view(b, hkv, -1, qz - qa)  # noqa: B023 - used in this iteration

            kg, vg = group_kv(i, g)
            (qt, qlo), (dt, dlo), (_, klo), (_, vlo) = (_operands(t, dtype) for t in (
                q[..., qa:qz, :], dout[..., qa:qz, :], kg[:, :, ka:kz], vg[:, :, ka:kz]))
            mo = None if m is None else m[:, u0:u1]
            if mo is not None and bool(mo.all()):
                mo = None
            w = u1 - u0
            kt, vt = k[:, :, o:o + w], v[:, :, o:o + w]
            rows_q, rows_dout = (t.reshape(b, hkv, -1, d) for t in (qt, dt))  # (B, Hkv, g q, D)
            raw = sr.qk(qlo, _t(klo))[..., u0:u1]  # the rows pass's tile, this share's columns
            dp = _lo_matmul(dtype, dlo, _t(vlo))[..., u0:u1]
            pb, drawb = _base_backward(raw, dp, rnd, mo, scale, tuple(map(rows_of, normb_all)), rows_of(stb.delta),
                                       sr.scores())
            dkb[:, :, o:o + w] += torch.matmul(_keys_side(drawb), rows_q.float())
            dvb[:, :, o:o + w] += torch.matmul(_keys_side(pb), rows_dout.float())
            p, ds, draw = _backward(torch.matmul(qt, _t(kt)), torch.matmul(dt, _t(vt)), mo, scale,
                                    tuple(map(rows_of, norm_all)), rows_of(st.delta))
            dk[:, :, o:o + w] += torch.matmul(_keys_side(draw), rows_q)
            dv[:, :, o:o + w] += torch.matmul(_keys_side(p), rows_dout)
            cols["ds"][..., o:o + w] += ds.abs_().sum(dim=(2, 3))
            cols["p"][..., o:o + w] += p.sum(dim=(2, 3))
            cols["pa"][..., o:o + w] += p.mul_(rows_of(st.amp).unsqueeze(-1)).sum(dim=(2, 3))
            del pb, drawb, p, ds, draw
        trim(0)

    def part(dk, dv, out_dtype, cols, max_k, max_v):  # (B, c, Hkv, D)
        dk, dv = (t.permute(0, 2, 1, 3).contiguous().to(out_dtype) for t in (dk, dv))
        return KeysPart(keys, dk, dv, cols, max_k, max_v)

    ref = part(dk, dv, torch.float64, cols, _amax(k), _amax(v))
    base = part(rnd(dkb), rnd(dvb), dtype, {}, 0.0, 0.0)
    ref.seconds = time.perf_counter() - t0
    return ref, base


class TermScales:
    """The magnitude of the terms each result is summed from, in float64 (not of the result itself, which can
    be exactly 0, e.g. dq of a query that sees one key). With p the probabilities, dP = dout . v, D = dout . out
    and dS = p (dP - D) (per query head; dk, dv sum over the query heads of each kv head's group):

    out  terms   max_{i,d} sum_j p_ij |v_jd|                     (A = that, dotted with |dout_i|)
    dq   terms   scale max|k| max_i sum_j |dS_ij|;   D   scale max|k| max_i A_i
    dk   terms   scale max|q| max_j sum_i |dS_ij|;   D   scale max|q| max_j sum_i p_ij A_i
    dv   terms   max|dout| max_j sum_i p_ij
    lse  terms   scale max|q| max|k|
    blocks       max|v|: every block's partial out is a convex combination of v rows, so no larger

    A_i = sum_j p_ij sum_d |dout_id| |v_jd| bounds the error of D_i made by rounding P, partial outputs and
    out, and D itself (harness/judging/tolerance.py, docs/tolerance.md). The row maxima come from the shares'
    rows passes (max over shares), the column sums from their keys passes (each key's sum made whole by the
    share that owns the key)."""

    def __init__(self, rows: Sequence[RowsPart], keys: Sequence[KeysPart]) -> None:
        self.maxima = {name: max((p.maxima.get(name, 0.0) for p in rows), default=0.0)
                       for name in ("out", "dq", "dq_d", "max_q", "max_dout")}
        self.max_k = max((p.max_k for p in keys), default=0.0)
        self.max_v = max((p.max_v for p in keys), default=0.0)
        self.top = {name: max((float(p.cols[name].max()) for p in keys if p.cols[name].numel()), default=0.0)
                    for name in ("ds", "pa", "p")}

    def scales(self, scale: float) -> dict[str, dict[str, float]]:
        """{tensor: {rounding class: scale}} for the tolerance rule."""
        mq, mk, mdo, x = self.maxima["max_q"], self.max_k, self.maxima["max_dout"], self.maxima
        return {"out": {"terms": x["out"]}, "lse": {"terms": scale * mq * mk},
                "dq": {"terms": scale * mk * x["dq"], "D": scale * mk * x["dq_d"]},
                "dk": {"terms": scale * mq * self.top["ds"], "D": scale * mq * self.top["pa"]},
                "dv": {"terms": mdo * self.top["p"]}, "blocks": {"max_v": self.max_v}}


def gather_stats(rows: Sequence[RowsPart], n: int) -> RowStats:
    """Every row's statistics, (B, Hq, n), from the rows passes of all the shares of one compute dtype."""
    first = rows[0]
    b, hq = first.mx.shape[:2]

    def whole(name: str) -> torch.Tensor | None:
        if getattr(first, name) is None:
            return None
        t = getattr(first, name).new_zeros(b, hq, n)
        for p in rows:
            t.index_copy_(2, p.rows.to(t.device), getattr(p, name))
        return t

    return RowStats(whole("mx"), whole("total"), whole("delta"), whole("amp"))


# -- one rank's share of a case ---------------------------------------------------------------------------

def positions(case: Case, index: int) -> torch.Tensor:
    """The global positions of share `index` (group rank): the rows and the keys that rank holds."""
    return all_positions(case.layout, case.seq_lens)[index]


WHOLE_INPUTS_BYTES = 16 << 20  # a case whose four global inputs fit here makes each once
_WHOLE: dict = {"key": None, "tensors": {}}  # the last small case's whole inputs: both passes, every local share


def case_fetch(case: Case, device="cpu") -> Fetch:
    """Inputs of the case made from its seed for any positions, on `device`. The sweeps ask for every key (or
    query) block again and again; a small case makes each whole tensor once (kept for the case's next pass or
    share in this process) and indexes it (the same values: inputs are made per token), a long one makes each
    block when asked and keeps nothing."""
    size = 4 * case.batch * case.total_len * case.heads_q * case.head_dim * 4
    if size > WHOLE_INPUTS_BYTES:
        return lambda name, pos: inputs.make(case, name, pos).to(device)
    key = (case.replace(impl="-", faults=(), tolerance={}, deadline_s=1.0).key(), str(device))
    if _WHOLE["key"] != key:
        _WHOLE.update(key=key, tensors={})
    whole = _WHOLE["tensors"]

    def fetch(name: str, pos: torch.Tensor) -> torch.Tensor:
        if name not in whole:
            whole[name] = inputs.make(case, name, torch.arange(case.total_len)).to(device)
        return whole[name][:, pos.to(device)]

    return fetch


def blocks(case: Case) -> list[torch.Tensor]:
    """Every share's blocks of positions (`_runs` of its positions, shares in order): the rows passes' query
    blocks, and so the keys passes'."""
    size = block(case)
    return [pos[a:z] for pos in all_positions(case.layout, case.seq_lens) for a, z in _runs(pos, size)]


def key_groups(case: Case) -> list[Group]:
    """The case's canonical key groups (`Group`)."""
    return groups(all_positions(case.layout, case.seq_lens), block(case))


def _work(case: Case) -> int:
    """Score entries of the largest share's pass: batch x query heads x its positions x every position."""
    return case.batch * case.heads_q * case.total_len * max(case.seq_lens, default=0)


def share_rows(case: Case, index: int, device="cpu") -> tuple[RowsPart, RowsPart]:
    """(float64, base) rows passes of share `index`, computed on `device`, returned on the CPU."""
    _trimmer(_work(case))(0)  # what the rank's run left in glibc's heap goes back first: a long share's peak is its own
    parts = rows_part(case_fetch(case, device), positions(case, index), [g.pos for g in key_groups(case)],
                      case.heads_kv, case.mask, case.scale, TORCH_DTYPES[case.dtype], block(case),
                      case.values in FLASH_BASE_VALUES)
    return tuple(p.cpu() for p in parts)


def share_keys(case: Case, index: int, stats: Sequence[RowStats], device="cpu") -> tuple[KeysPart, KeysPart]:
    """(float64, base) keys passes of share `index` given every row's (float64, base) statistics."""
    _trimmer(_work(case))(0)
    parts = keys_part(case_fetch(case, device), positions(case, index), index, blocks(case), key_groups(case),
                      case.heads_kv, stats, case.mask, case.scale, TORCH_DTYPES[case.dtype],
                      case.values in FLASH_BASE_VALUES)
    return tuple(p.cpu() for p in parts)
