"""One share of the oracle: float64 and same-dtype base, split by query rows and by keys.

Share g is the positions rank g holds under the case's layout. It is computed in two passes. The
rows pass (`rows_part`) takes the share's queries against every key: out, lse, dq and the rows'
statistics. The keys pass (`keys_part`) takes every query against the share's keys, given every
row's statistics (`gather_stats`): dk, dv and the term scales' column sums. `share_rows` and
`share_keys` run them for a case on a rank's device. docs/oracle.md has the derivation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from harness import inputs
from harness.case import Case
from harness.dtypes import TORCH_DTYPES
from harness.inputs import FLASH_BASE_VALUES
from harness.oracle import tiles
from harness.oracle.numerics import (
    ScoreRounding,
    amax,
    backward,
    base_backward,
    base_scores,
    group_heads,
    keys_side,
    keys_t,
    kv_heads,
    lo_matmul,
    load,
    masked,
    norm_rows,
    normaliser,
    online,
    operands,
    probs,
    rounder,
    ungroup_heads,
)
from harness.oracle.tiles import Group, runs, trimmer, visible_tiles
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec

# (q/k/v/dout, global positions) -> (B, len, heads, D)
Fetch = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class RowStats:
    """What the keys pass needs of every query row, one compute dtype, (B, Hq, N).

    The softmax's row max and sum of exp(s - max); D (float64: rowsum(dout * out); the base:
    sum_j P_ij dP_ij); and, float64 only, A, the term scale of D (`TermScales`)."""

    mx: torch.Tensor
    total: torch.Tensor
    delta: torch.Tensor
    amp: torch.Tensor | None = None

    def to(self, device) -> RowStats:
        moved = (
            None if t is None else t.to(device) for t in (self.mx, self.total, self.delta, self.amp)
        )
        return RowStats(*moved)


@dataclass
class RowsPart:
    """The rows pass of one share, one compute dtype.

    Its query rows' out, lse and dq, their statistics (`RowStats`), and, float64 only, the row
    maxima of the term scales: out, dq, dq_d, max_q, max_dout."""

    rows: torch.Tensor  # (r,) global query positions, in the order of the rows below
    out: torch.Tensor  # (B, r, Hq, D) in the compute dtype
    lse: torch.Tensor  # (B, Hq, r) float64 / float32
    dq: torch.Tensor  # (B, r, Hq, D)
    # (B, Hq, r) in the accumulation dtype: the rows' score max (-inf: sees no key)
    mx: torch.Tensor
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
    """The keys pass of one share, one compute dtype.

    Its keys' dk and dv from every query. Float64 only: the term scales' column sums over every
    query (ds, pa, p: (B, Hkv, c)), max|k| and max|v|."""

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


# -- the two passes -------------------------------------------------------------------------


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
) -> tuple[RowsPart, RowsPart]:
    """The rows pass of query rows `rows` (a share's global positions) against every key group
    (`key_blocks`: their positions), float64 and the base in `dtype`. Three sweeps over the key
    blocks some row sees, each block fetched once per sweep: (1) the softmax's max and sum, and the
    float64 out by an online softmax; (2) the base's out and D (P is normalised before it is
    rounded); (3) dq. `exact_scores`: the base keeps its scores in float32 (`ScoreRounding`)."""
    t0 = time.perf_counter()
    rnd = rounder(dtype)
    sr = ScoreRounding(dtype, exact_scores)
    srnd = sr.scores()
    q, dout = (group_heads(load(fetch(name, rows), dtype), heads_kv) for name in ("q", "dout"))
    b, hkv, g, r, d = q.shape
    device = q.device
    qblocks = runs(rows, size)
    trim = trimmer(b * hkv * g * r * sum(kp.numel() for kp in key_blocks))

    def sweep(q: torch.Tensor, dout: torch.Tensor):
        """Every tile in which some query sees some key: queries a:z, mask, and the (float64, base
        operand) pairs of the tile's q, dout, k, v (k, v: (B, Hkv, c, D))."""
        for kpos in key_blocks:
            visible = visible_tiles(mask, rows, qblocks, kpos, [(0, kpos.numel())], device)
            if visible:  # the tile masks are made again each sweep: r x n of them would not fit
                k, v = (kv_heads(load(fetch(name, kpos), dtype)) for name in ("k", "v"))
                for a, z, ka, kz, m in visible:
                    yield (
                        a,
                        z,
                        m,
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
            trim(0)

    f64, f32 = dict(dtype=torch.float64, device=device), dict(dtype=torch.float32, device=device)
    mx, total = torch.full((b, hkv, g, r), float("-inf"), **f64), torch.zeros((b, hkv, g, r), **f64)
    mxb, totalb = (
        torch.full((b, hkv, g, r), float("-inf"), **f32),
        torch.zeros((b, hkv, g, r), **f32),
    )
    out, outb = torch.zeros_like(q), torch.zeros_like(q, dtype=torch.float32)
    pv = torch.zeros_like(q)  # the term scale sum_j p_ij |v_jd|
    for a, z, m, (qt, qlo), _, (kt, klo), (vt, _) in sweep(q, dout):  # (1)
        online(mxb, totalb, base_scores(sr.qk(qlo, keys_t(klo)), srnd, scale, m), a, z)
        p, alpha = online(mx, total, masked(torch.matmul(qt, keys_t(kt)).mul_(scale), m), a, z)
        out[..., a:z, :] = out[..., a:z, :] * alpha.unsqueeze(-1) + torch.matmul(p, vt.unsqueeze(2))
        pv[..., a:z, :] = pv[..., a:z, :] * alpha.unsqueeze(-1) + torch.matmul(
            p, vt.abs().unsqueeze(2)
        )
        del p
    norm, normb = normaliser(mx, total), normaliser(mxb, totalb)
    out.div_(norm[1].unsqueeze(-1))
    pv.div_(norm[1].unsqueeze(-1))
    delta = (dout * out).sum(dim=-1)  # (B, Hkv, g, r)
    amp = (dout.abs() * pv).sum(dim=-1)
    maxima = {"out": amax(pv), "dq_d": amax(amp), "max_q": amax(q), "max_dout": amax(dout)}
    del pv
    deltab = torch.zeros((b, hkv, g, r), **f32)
    for a, z, m, (_, qlo), (_, dlo), (_, klo), (vt, vlo) in sweep(q, dout):  # (2)
        p = rnd(probs(base_scores(sr.qk(qlo, keys_t(klo)), srnd, scale, m), norm_rows(normb, a, z)))
        outb[..., a:z, :] += torch.matmul(p, vt.float().unsqueeze(2))
        deltab[..., a:z] += p.mul_(lo_matmul(dtype, dlo, keys_t(vlo))).sum(dim=-1)
        del p
    outb = rnd(outb)
    dq, dqb = torch.zeros_like(q), torch.zeros_like(q, dtype=torch.float32)
    ds_rows = torch.zeros((b, hkv, g, r), **f64)
    for a, z, m, (qt, qlo), (dt, dlo), (kt, klo), (vt, vlo) in sweep(q, dout):  # (3)
        _, drawb = base_backward(
            sr.qk(qlo, keys_t(klo)),
            lo_matmul(dtype, dlo, keys_t(vlo)),
            rnd,
            m,
            scale,
            norm_rows(normb, a, z),
            deltab[..., a:z],
            srnd,
        )
        dqb[..., a:z, :] += torch.matmul(drawb, kt.float().unsqueeze(2))
        _, ds, draw = backward(
            torch.matmul(qt, keys_t(kt)),
            torch.matmul(dt, keys_t(vt)),
            m,
            scale,
            norm_rows(norm, a, z),
            delta[..., a:z],
        )
        dq[..., a:z, :] += torch.matmul(draw, kt.unsqueeze(2))
        ds_rows[..., a:z] += ds.abs_().sum(dim=-1)
        del ds, draw, drawb
    del q, dout
    exact = _rows_part(rows, out, dq, mx, total, delta, amp, torch.float64)
    exact.maxima = {**maxima, "dq": amax(ds_rows)}
    del out, dq
    base = _rows_part(rows, outb, dqb, mxb, totalb, deltab, None, dtype)
    exact.seconds = time.perf_counter() - t0
    return exact, base


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
) -> tuple[KeysPart, KeysPart]:
    """The keys pass of share `share` against every query, float64 and the base in `dtype`.

    `keys` are the share's global positions. `query_blocks` are every share's query blocks
    (`blocks`), and `stats` every row's (float64, base) statistics, by global position. Each tile of
    a query block against a key group holding some of its keys is computed as the rows pass
    computes it (`Group`). One sweep over the query blocks that see some of its keys, each fetched
    once. `exact_scores`: as in `rows_part`."""
    t0 = time.perf_counter()
    rnd = rounder(dtype)
    sr = ScoreRounding(dtype, exact_scores)
    k, v = (kv_heads(load(fetch(name, keys), dtype)) for name in ("k", "v"))
    b, hkv, c, d = k.shape
    n = sum(qp.numel() for qp in query_blocks)
    trim = trimmer(b * stats[0].mx.shape[1] * n * c)  # batch x query heads x queries x keys
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dkb, dvb = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    cols = {
        name: torch.zeros(b, hkv, c, dtype=torch.float64, device=k.device)
        for name in ("ds", "pa", "p")
    }
    st, stb = (s.to(k.device) for s in stats)
    norm_all, normb_all = normaliser(st.mx, st.total), normaliser(stb.mx, stb.total)
    mine = list(enumerate(g for g in key_groups if share in g.own))
    # a group holding others' keys: its k, v (one tile side)
    others: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def group_kv(i: int, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        c0, c1, o0 = g.own[share]
        if c0 == 0 and c1 == g.pos.numel():  # the whole group is this share's
            return k[:, :, o0 : o0 + c1], v[:, :, o0 : o0 + c1]
        if i not in others:
            others[i] = tuple(kv_heads(load(fetch(name, g.pos), dtype)) for name in ("k", "v"))
        return others[i]

    for qpos in query_blocks:
        work = _share_tiles(mask, qpos, mine, share, k.device)
        if not work:
            continue
        q, dout = (group_heads(load(fetch(name, qpos), dtype), hkv) for name in ("q", "dout"))
        for i, g, qa, qz, ka, kz, m, u0, u1, o in work:
            at = qpos[qa:qz].to(k.device)

            # the tile's rows of a (B, Hq, N) statistic
            def rows_of(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(-1, at).view(b, hkv, -1, qz - qa)  # noqa: B023 - used in this iteration

            kg, vg = group_kv(i, g)
            (qt, qlo), (dt, dlo), (_, klo), (_, vlo) = (
                operands(t, dtype)
                for t in (q[..., qa:qz, :], dout[..., qa:qz, :], kg[:, :, ka:kz], vg[:, :, ka:kz])
            )
            mo = None if m is None else m[:, u0:u1]
            if mo is not None and bool(mo.all()):
                mo = None
            w = u1 - u0
            kt, vt = k[:, :, o : o + w], v[:, :, o : o + w]
            rows_q, rows_dout = (t.reshape(b, hkv, -1, d) for t in (qt, dt))  # (B, Hkv, g q, D)
            raw = sr.qk(qlo, keys_t(klo))[..., u0:u1]  # the rows pass's tile, this share's columns
            dp = lo_matmul(dtype, dlo, keys_t(vlo))[..., u0:u1]
            pb, drawb = base_backward(
                raw,
                dp,
                rnd,
                mo,
                scale,
                tuple(map(rows_of, normb_all)),
                rows_of(stb.delta),
                sr.scores(),
            )
            dkb[:, :, o : o + w] += torch.matmul(keys_side(drawb), rows_q.float())
            dvb[:, :, o : o + w] += torch.matmul(keys_side(pb), rows_dout.float())
            p, ds, draw = backward(
                torch.matmul(qt, keys_t(kt)),
                torch.matmul(dt, keys_t(vt)),
                mo,
                scale,
                tuple(map(rows_of, norm_all)),
                rows_of(st.delta),
            )
            dk[:, :, o : o + w] += torch.matmul(keys_side(draw), rows_q)
            dv[:, :, o : o + w] += torch.matmul(keys_side(p), rows_dout)
            cols["ds"][..., o : o + w] += ds.abs_().sum(dim=(2, 3))
            cols["p"][..., o : o + w] += p.sum(dim=(2, 3))
            cols["pa"][..., o : o + w] += p.mul_(rows_of(st.amp).unsqueeze(-1)).sum(dim=(2, 3))
            del pb, drawb, p, ds, draw
        trim(0)

    def part(dk, dv, out_dtype, cols, max_k, max_v):  # (B, c, Hkv, D)
        dk, dv = (t.permute(0, 2, 1, 3).contiguous().to(out_dtype) for t in (dk, dv))
        return KeysPart(keys, dk, dv, cols, max_k, max_v)

    exact = part(dk, dv, torch.float64, cols, amax(k), amax(v))
    base = part(rnd(dkb), rnd(dvb), dtype, {}, 0.0, 0.0)
    exact.seconds = time.perf_counter() - t0
    return exact, base


# (group index, group, qa, qz, ka, kz, mask, u0, u1, o): one tile of a share's keys pass
Work = tuple


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


# -- combining the shares -------------------------------------------------------------------


class TermScales:
    """The magnitude of the terms each result is summed from, in float64.

    Not of the result itself, which can be exactly 0 (dq of a query that sees one key). The row
    maxima come from the shares' rows passes, the column sums from their keys passes. docs/oracle.md
    ("Term scales") has the table of what each scale is."""

    def __init__(self, rows: Sequence[RowsPart], keys: Sequence[KeysPart]) -> None:
        self.maxima = {
            name: max((p.maxima.get(name, 0.0) for p in rows), default=0.0)
            for name in ("out", "dq", "dq_d", "max_q", "max_dout")
        }
        self.max_k = max((p.max_k for p in keys), default=0.0)
        self.max_v = max((p.max_v for p in keys), default=0.0)
        self.top = {
            name: max(
                (float(p.cols[name].max()) for p in keys if p.cols[name].numel()), default=0.0
            )
            for name in ("ds", "pa", "p")
        }

    def scales(self, scale: float) -> dict[str, dict[str, float]]:
        """{tensor: {rounding class: scale}} for the tolerance rule."""
        mq, mk, mdo, x = self.maxima["max_q"], self.max_k, self.maxima["max_dout"], self.maxima
        return {
            "out": {"terms": x["out"]},
            "lse": {"terms": scale * mq * mk},
            "dq": {"terms": scale * mk * x["dq"], "D": scale * mk * x["dq_d"]},
            "dk": {"terms": scale * mq * self.top["ds"], "D": scale * mq * self.top["pa"]},
            "dv": {"terms": mdo * self.top["p"]},
            "blocks": {"max_v": self.max_v},
        }


def gather_stats(rows: Sequence[RowsPart], n: int) -> RowStats:
    """Every row's statistics, (B, Hq, n), from the rows passes of all the shares of one compute
    dtype."""
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


# -- one rank's share of a case -------------------------------------------------------------


def positions(case: Case, index: int) -> torch.Tensor:
    """The global positions of share `index` (group rank): the rows and the keys that rank holds."""
    return all_positions(case.layout, case.seq_lens)[index]


WHOLE_INPUTS_BYTES = 16 << 20  # a case whose four global inputs fit here makes each once
# the last small case's whole inputs: both passes, every local share
_WHOLE: dict = {"key": None, "tensors": {}}


def case_fetch(case: Case, device="cpu") -> Fetch:
    """Inputs of the case made from its seed for any positions, on `device`.

    The sweeps ask for every block again and again. A small case makes each whole tensor once,
    keeps it for the case's next pass or share in this process, and indexes it: inputs are made
    per token, so the values are the same. A long case makes each block when asked and keeps
    nothing."""
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


def _work(case: Case) -> int:
    """Score entries of the largest share's pass: batch x query heads x its positions x every
    position."""
    return case.batch * case.heads_q * case.total_len * max(case.seq_lens, default=0)


def share_rows(case: Case, index: int, device="cpu") -> tuple[RowsPart, RowsPart]:
    """(float64, base) rows passes of share `index`, computed on `device`, returned on the CPU."""
    # what the rank's run left in glibc's heap goes back first: a long share's peak is its own
    trimmer(_work(case))(0)
    parts = rows_part(
        case_fetch(case, device),
        positions(case, index),
        [g.pos for g in tiles.key_groups(case)],
        case.heads_kv,
        case.mask,
        case.scale,
        TORCH_DTYPES[case.dtype],
        tiles.block(case),
        case.values in FLASH_BASE_VALUES,
    )
    return tuple(p.cpu() for p in parts)


def share_keys(
    case: Case, index: int, stats: Sequence[RowStats], device="cpu"
) -> tuple[KeysPart, KeysPart]:
    """(float64, base) keys passes of share `index` given every row's (float64, base) statistics."""
    trimmer(_work(case))(0)
    parts = keys_part(
        case_fetch(case, device),
        positions(case, index),
        index,
        tiles.blocks(case),
        tiles.key_groups(case),
        case.heads_kv,
        stats,
        case.mask,
        case.scale,
        TORCH_DTYPES[case.dtype],
        case.values in FLASH_BASE_VALUES,
    )
    return tuple(p.cpu() for p in parts)
