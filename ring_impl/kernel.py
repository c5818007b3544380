"""Block attention kernel: one (query shard, key/value block) pair, forward and backward, in float32.

The ring calls these for every block. Forward returns the block's normalised output and its
log-sum-exp so blocks can be merged; backward is the flash-attention backward computed from the
GLOBAL (merged) output and lse, so per-block gradients simply add up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KvHeads = Callable[[int, int], torch.Tensor]


def gqa_kv_heads(heads_q: int, heads_kv: int) -> torch.Tensor:
    """Key/value head used by each query head: h // (Hq / Hkv), flash-attn's GQA/MQA convention."""
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    return torch.arange(heads_q) // (heads_q // heads_kv)


def _expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: KvHeads):
    """float32 q, and k/v with their heads expanded to the query heads; plus the head index."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"expected q (B, Lq, Hq, D), k = v (B, Lk, Hkv, D); got {q.shape}, {k.shape}, {v.shape}"
        )
    idx = kv_heads(q.shape[2], k.shape[2]).to(q.device)
    return q.float(), k.float().index_select(2, idx), v.float().index_select(2, idx), idx


def _scores(qf: torch.Tensor, kf: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled scores (B, Hq, Lq, Lk); masked entries are -inf."""
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if mask is not None:
        s = s.masked_fill(~mask.to(s.device), float("-inf"))
    return s


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    *,
    kv_heads: KvHeads = gqa_kv_heads,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one k/v block: out float32 (B, Lq, Hq, D), lse float32 (B, Hq, Lq).

    Max-subtracted softmax, so scores of any magnitude are safe; rows with no visible key get
    lse = -inf and out = 0.
    """
    qf, kf, vf, _ = _expanded(q, k, v, kv_heads)
    s = _scores(qf, kf, scale, mask)
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


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    *,
    kv_heads: KvHeads = gqa_kv_heads,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv), float32, of one block given the GLOBAL out and lse of the queries.

    dk/dv are summed over each GQA group (shape of k/v). Masked entries have probability exactly
    0, so keys no query may see get dk = dv = 0 exactly.
    """
    qf, kf, vf, idx = _expanded(q, k, v, kv_heads)
    s = _scores(qf, kf, scale, mask)
    lse = lse.float()
    finite = torch.isfinite(lse).unsqueeze(-1)
    p = torch.exp(s - torch.where(finite, lse.unsqueeze(-1), torch.zeros_like(lse.unsqueeze(-1))))
    p = p.masked_fill(~finite, 0.0)
    do = dout.float()
    delta = (do * out.float()).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # (B, Hq, Lq, 1)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    ds = p * (dp - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk_q = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv_q = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device).index_add_(2, idx, dk_q)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device).index_add_(2, idx, dv_q)
    return dq, dk, dv
