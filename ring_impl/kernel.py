"""Block attention kernel: one (query shard, key/value block) pair, forward and backward, in
float32.

The ring calls these for every block. Forward returns the block's normalised output and its
log-sum-exp so blocks can be merged; backward is the flash-attention backward computed from the
GLOBAL (merged) output and lse, so per-block gradients simply add up.

Two paths, one numerics contract (float32 from the input-dtype values, float32 accumulation):

- one tile: a block whose score matrix (B x Hq x Lq x Lk entries) fits the device's tile budget
  (`tile_scores`) is computed whole, exactly as it always was: every battery and corpus case takes
  this path, so their recorded output hashes do not change.
- tiled (flash-style): a larger block is computed in query x key tiles of `tile_for` tokens with a
  running max and sum (forward) and the global lse (backward), so no (Lq x Lk) tensor exists; a
  rank's peak memory is O(L/W x d + tile^2). The results differ from the one-tile path only by
  float32 rounding (sums split over key tiles): within the same bound (tests/ring/test_tiles.py).

The mask may be a bool (Lq, Lk) tensor, None, or a `TileMask` (the ring's lazy position mask, whose
tiles are computed on demand); tiles no query of which may see any key are skipped (exactly: they
would contribute probability 0).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ring_impl.variants import Scores

KvHeads = Callable[[int, int], torch.Tensor]

# the tile budget in score entries (B x Hq x tile_q x tile_k): 4 Mi entries, a 16 MiB float32 matrix
# and ~100 MiB of backward workspace on CPU (the ring's 1024 x 1024 x h4 blocks of the speed
# benchmark are one tile). Environment override (tests, small machines): RING_TILE_SCORES.
CPU_TILE_SCORES = 1 << 22
# clamp of free memory / 512 bytes (~1/20 of it for the workspace)
GPU_TILE_SCORES = (1 << 22, 1 << 28)
TILE_ENV = "RING_TILE_SCORES"
MIN_TILE = 16


def gqa_kv_heads(heads_q: int, heads_kv: int) -> torch.Tensor:
    """Key/value head used by each query head: h // (Hq / Hkv), flash-attn's GQA/MQA convention."""
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(
            f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})"
        )
    return torch.arange(heads_q) // (heads_q // heads_kv)


# -- tiles ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileMask:
    """A block's mask computed tile by tile: `tile(q_slice, k_slice)` is the bool (tq, tk) mask of
    those queries and keys, or None (all allowed). The ring hands one to the kernel for blocks
    larger than a tile, so no (Lq, Lk) mask is ever built."""

    fn: Callable[[slice, slice], torch.Tensor | None]
    shape: tuple[int, int]

    def tile(self, qs: slice, ks: slice) -> torch.Tensor | None:
        return self.fn(qs, ks)


Mask = torch.Tensor | TileMask | None


def tile_scores(device: torch.device | str | None = None) -> int:
    """The tile budget in score entries for `device`: $RING_TILE_SCORES, else a fixed 4 Mi on CPU,
    else free accelerator memory / 512 bytes clamped to [4 Mi, 256 Mi]."""
    env = os.environ.get(TILE_ENV)
    if env:
        return max(1, int(env))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(dev)
        lo, hi = GPU_TILE_SCORES
        return max(lo, min(hi, free // 512))
    return CPU_TILE_SCORES


def tile_for(batch_heads: int, budget: int) -> int:
    """Tile side in tokens: the largest power of two t with batch_heads * t * t <= budget (>=
    MIN_TILE)."""
    t = math.isqrt(max(1, budget // max(1, batch_heads)))
    return max(MIN_TILE, 1 << (t.bit_length() - 1) if t else 0)


def needs_tiles(batch: int, heads_q: int, len_q: int, len_k: int, device=None) -> bool:
    """True when the block's score matrix exceeds the device's tile budget (the kernel then
    tiles)."""
    return batch * heads_q * len_q * len_k > tile_scores(device)


def _plan(q: torch.Tensor, k: torch.Tensor, tile: int | None) -> int | None:
    """The tile side for this block, or None for the one-tile (untiled) path."""
    b, lq, hq, _ = q.shape
    lk = k.shape[1]
    if lq == 0 or lk == 0:
        return None
    if tile is not None:
        return int(tile) if lq > tile or lk > tile else None
    budget = tile_scores(q.device)
    return tile_for(b * hq, budget) if b * hq * lq * lk > budget else None


def _tile_fn(mask: Mask) -> Callable[[slice, slice], torch.Tensor | None]:
    if mask is None:
        return lambda qs, ks: None
    if isinstance(mask, TileMask):
        return mask.tile
    return lambda qs, ks: mask[qs, ks]


def _whole(mask: Mask) -> torch.Tensor | None:
    """The whole block's mask (the one-tile path)."""
    return mask.tile(slice(None), slice(None)) if isinstance(mask, TileMask) else mask


# -- shared pieces -------------------------------------------------------------------------------


def _expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: KvHeads):
    """float32 q, and k/v with their heads expanded to the query heads; plus the head index."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"expected q (B, Lq, Hq, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv); got {q.shape}, "
            f"{k.shape}, {v.shape}"
        )
    idx = kv_heads(q.shape[2], k.shape[2]).to(q.device)
    return q.float(), k.float().index_select(2, idx), v.float().index_select(2, idx), idx


def _scores(
    qf: torch.Tensor,
    kf: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    fn: Scores | None = None,
    qs: slice = slice(None),
    ks: slice = slice(None),
) -> torch.Tensor:
    """Scores (B, Hq, Lq, Lk): scaled, then the variant's (softcap, bias); masked entries -inf."""
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if fn is not None:
        s = fn.apply(s, qs, ks)
    if mask is not None:
        s = s.masked_fill(~mask.to(s.device), float("-inf"))
    return s


def _scores_grad(qf, kf, scale, mask, fn: Scores | None, qs=slice(None), ks=slice(None)):
    """(scores, the variant's factor c_ij = d final / d scaled score or None) for a backward."""
    if fn is None or fn.variant.softcap is None:
        return _scores(qf, kf, scale, mask, fn, qs, ks), None
    raw = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    return _scores(qf, kf, scale, mask, fn, qs, ks), fn.factor(raw)


def _tiles(n: int, t: int) -> list[slice]:
    return [slice(i, min(n, i + t)) for i in range(0, n, t)]


def _empty(m: torch.Tensor | None) -> bool:
    return m is not None and not bool(m.any())


# -- forward -------------------------------------------------------------------------------------


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: Mask = None,
    *,
    kv_heads: KvHeads = gqa_kv_heads,
    tile: int | None = None,
    scores: Scores | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one k/v block: out float32 (B, Lq, Hq, Dv), lse float32 (B, Hq, Lq).

    Max-subtracted softmax, so scores of any magnitude are safe; rows with no visible key get
    lse = -inf and out = 0. `tile`: force tiles of that many tokens (None: from the device budget).
    `scores`: the block's variant (softcap, ALiBi from its global positions), None for plain.
    """
    qf, kf, vf, _ = _expanded(q, k, v, kv_heads)
    t = _plan(q, k, tile)
    if t is None:
        return _forward_whole(qf, kf, vf, scale, _whole(mask), scores)
    return _forward_tiled(qf, kf, vf, scale, _tile_fn(mask), t, scores)


def _forward_whole(qf, kf, vf, scale, mask, fn=None):
    s = _scores(qf, kf, scale, mask, fn)
    if s.shape[-1] == 0:
        return qf.new_zeros(qf.shape[:3] + (vf.shape[-1],)), s.new_full(s.shape[:3], float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    visible = denom > 0
    p = p / torch.where(visible, denom, torch.ones_like(denom))
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    lse = torch.where(visible, row_max + torch.log(denom), torch.full_like(denom, float("-inf")))
    return out, lse.squeeze(-1)


def _forward_tiled(qf, kf, vf, scale, mask_tile, t, fn=None):
    """Online softmax over key tiles for each query tile: running max m, sum l, unnormalised acc."""
    b, lq, h, _ = qf.shape
    out = qf.new_zeros(qf.shape[:3] + (vf.shape[-1],))
    lse = qf.new_full((b, h, lq), float("-inf"))
    key_tiles = _tiles(kf.shape[1], t)
    for qs in _tiles(lq, t):
        qt = qf[:, qs]
        n = qt.shape[1]
        m = qf.new_full((b, h, n, 1), float("-inf"))
        l = qf.new_zeros((b, h, n, 1))  # noqa: E741
        acc = qf.new_zeros((b, h, n, vf.shape[-1]))
        for ks in key_tiles:
            mt = mask_tile(qs, ks)
            if _empty(mt):
                continue
            s = _scores(qt, kf[:, ks], scale, mt, fn, qs, ks)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(m - m_safe)  # 0 while the row has seen no key (m = -inf)
            p = torch.exp(s - m_safe)
            del s
            l = l * alpha + p.sum(dim=-1, keepdim=True)  # noqa: E741
            acc = acc * alpha + torch.einsum("bhqk,bkhd->bhqd", p, vf[:, ks])
            m = m_new
        visible = l > 0
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        out[:, qs] = (acc / torch.where(visible, l, torch.ones_like(l))).transpose(1, 2)
        lse[:, :, qs] = torch.where(
            visible, m_safe + torch.log(l), torch.full_like(l, float("-inf"))
        ).squeeze(-1)
    return out, lse


# -- backward ------------------------------------------------------------------------------------


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: Mask = None,
    *,
    kv_heads: KvHeads = gqa_kv_heads,
    tile: int | None = None,
    scores: Scores | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv), float32, of one block given the GLOBAL out and lse of the queries.

    dk/dv are summed over each GQA group (shape of k/v). Masked entries have probability exactly
    0, so keys no query may see get dk = dv = 0 exactly. `tile` and `scores` as in `block_forward`;
    softcap's factor 1 - tanh^2 multiplies dS on its way to dq and dk.
    """
    qf, kf, vf, idx = _expanded(q, k, v, kv_heads)
    t = _plan(q, k, tile)
    lse = lse.float()
    do = dout.float()
    delta = (do * out.float()).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # (B, Hq, Lq, 1)
    if t is None:
        dq, dk_q, dv_q = _backward_whole(do, qf, kf, vf, lse, delta, scale, _whole(mask), scores)
    else:
        dq, dk_q, dv_q = _backward_tiled(
            do, qf, kf, vf, lse, delta, scale, _tile_fn(mask), t, scores
        )
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device).index_add_(2, idx, dk_q)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device).index_add_(2, idx, dv_q)
    return dq, dk, dv


def _backward_whole(do, qf, kf, vf, lse, delta, scale, mask, fn=None):
    s, c = _scores_grad(qf, kf, scale, mask, fn)
    finite = torch.isfinite(lse).unsqueeze(-1)
    p = torch.exp(s - torch.where(finite, lse.unsqueeze(-1), torch.zeros_like(lse.unsqueeze(-1))))
    p = p.masked_fill(~finite, 0.0)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    ds = p * (dp - delta)
    dv_q = torch.einsum("bhqk,bqhd->bkhd", p, do)
    if c is not None:
        ds = ds * c
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk_q = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    return dq, dk_q, dv_q


def _backward_tiled(do, qf, kf, vf, lse, delta, scale, mask_tile, t, fn=None):
    """The same products tile by tile; dq, dk, dv summed over tiles in float32, scaled once at the
    end."""
    finite = torch.isfinite(lse).unsqueeze(-1)
    lse_safe = torch.where(finite, lse.unsqueeze(-1), torch.zeros_like(lse.unsqueeze(-1)))
    dq = torch.zeros_like(qf)
    dk_q = torch.zeros_like(kf)
    dv_q = torch.zeros_like(vf)
    key_tiles = _tiles(kf.shape[1], t)
    for qs in _tiles(qf.shape[1], t):
        qt, dot = qf[:, qs], do[:, qs]
        fin, ls, dl = finite[:, :, qs], lse_safe[:, :, qs], delta[:, :, qs]
        for ks in key_tiles:
            mt = mask_tile(qs, ks)
            if _empty(mt):
                continue
            kt, vt = kf[:, ks], vf[:, ks]
            s, c = _scores_grad(qt, kt, scale, mt, fn, qs, ks)
            p = torch.exp(s - ls).masked_fill_(~fin, 0.0)
            del s
            ds = p * (torch.einsum("bqhd,bkhd->bhqk", dot, vt) - dl)
            if c is not None:
                ds = ds * c
            dq[:, qs] += torch.einsum("bhqk,bkhd->bqhd", ds, kt)
            dk_q[:, ks] += torch.einsum("bhqk,bqhd->bkhd", ds, qt)
            dv_q[:, ks] += torch.einsum("bhqk,bqhd->bkhd", p, dot)
    return dq * scale, dk_q * scale, dv_q
