"""Reference decode over a sharded KV cache: gathered queries, partial attention, an lse merge.

Each rank holds a share of every request's KV (`ring_impl.serving`). The few queries travel
instead of the cache:

1. gather: every rank gets every query (an all-gather of the owners' rows; replicated queries are
   already everywhere);
2. attend: each rank attends all queries to its own KV share, by global positions, giving a
   partial (out, lse) per row; a row that sees none of its keys has lse -inf and out 0;
3. merge: the partials of each row are combined by their lse (`ring_impl.merge`), which gives a
   -inf partial weight 0; the sink joins once, after the merge.

The merge comes in two forms, as engines run it. `all-gather`: every rank gathers every partial
and keeps its own rows. `all-to-all`: each rank sends each row's partial to the row's owner, so a
rank receives only its rows' W partials (replicated queries are split evenly for the merge, then
gathered). Forward only, as decode runs. A training case is a shape like any other: its queries
are its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ring_impl.masks import MaskSpec
from ring_impl.paged import PagedKV, read_kv
from ring_impl.parts import REFERENCE_PARTS, BlockAt, RingParts
from ring_impl.plan import NO_MASK, variant_of
from ring_impl.variants import sink_lse

FORMS = ("all-gather", "all-to-all")


def _gather_rows(x: torch.Tensor, sizes: Sequence[int], group: Any) -> torch.Tensor:
    """Every rank's rows of x (dim 1), in rank order: an all-gather of row blocks padded to the
    longest."""
    if len(sizes) == 1:
        return x
    most = max(sizes)
    padded = x.new_zeros((x.shape[0], most, *x.shape[2:]))
    padded[:, : x.shape[1]] = x
    got = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(got, padded.contiguous(), group=group)
    return torch.cat([g[:, :n] for g, n in zip(got, sizes, strict=True)], dim=1)


def forward_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str) -> None:
    """Refuse a call that would need a backward: these references compute none, so autograd
    would hand back no gradient or a partial one."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(f"{name} is forward-only: call it under no_grad or inference_mode")


def share_attention(
    parts: RingParts, q, k, v, q_pos, k_pos, at: BlockAt, mask: MaskSpec, scale, variant
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (out, lse) of the query rows q over one rank's KV share alone; a row that sees none
    of its keys gets lse -inf and out 0 (`parts.no_blocks`). The pass-Q ring uses it too."""
    acc = parts.acc_dtype(q.dtype)
    if q.shape[1] == 0 or k_pos.numel() == 0 or parts.skip_block(mask, q_pos, k_pos, at):
        return parts.no_blocks(q, v, acc)
    scores = None if variant.plain else parts.block_scores(variant, q_pos, k_pos, at, scale)
    extra = {} if scores is None else {"scores": scores}
    out, lse = parts.block_forward(
        q, k, v, scale, parts.block_mask(mask, q_pos, k_pos, at), kv_heads=parts.kv_heads, **extra
    )
    return out.to(acc), lse.to(acc)


def _merge_all(parts: RingParts, outs: Sequence, lses: Sequence) -> tuple:
    out, lse = outs[0], lses[0]
    for o, s in zip(outs[1:], lses[1:], strict=True):
        out, lse = parts.merge(out, lse, o, s)
    return out, lse


def _exchange(x: torch.Tensor, send: Sequence[int], recv: int, group: Any) -> list:
    """all_to_all of row blocks (dim 1): send[j] rows to rank j, `recv` rows from each rank.

    Each block is padded to the longest send, which every rank knows (gloo wants equal blocks)."""
    most = max(send)
    ins = []
    for t in torch.split(x, list(send), dim=1):
        block = x.new_zeros((x.shape[0], most, *x.shape[2:]))
        block[:, : t.shape[1]] = t
        ins.append(block)
    outs = [torch.empty_like(ins[0]) for _ in send]
    dist.all_to_all(outs, ins, group=group)
    return [t[:, :recv] for t in outs]


def _split_evenly(n: int, world: int) -> list[int]:
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def _merged_all_to_all(parts, out_p, lse_p, rows: Sequence[int], replicated: bool, rank, group):
    """Each rank merges the W partials of its rows; replicated rows are then gathered."""
    world = len(rows)
    mine = _split_evenly(out_p.shape[1], world) if replicated else list(rows)
    lse_rows = lse_p.transpose(1, 2).contiguous()  # (B, L, H): rows along dim 1
    outs = _exchange(out_p, mine, mine[rank], group)
    lses = [t.transpose(1, 2) for t in _exchange(lse_rows, mine, mine[rank], group)]
    out, lse = _merge_all(parts, outs, lses)
    if not replicated:
        return out, lse
    out = _gather_rows(out, mine, group)
    lse = _gather_rows(lse.transpose(1, 2).contiguous(), mine, group).transpose(1, 2)
    return out, lse


def _merged_all_gather(parts, out_p, lse_p, rows: Sequence[int], replicated: bool, rank, group):
    """Every rank gathers every partial, merges, and keeps its own rows."""
    world = len(rows)
    outs = [torch.empty_like(out_p) for _ in range(world)]
    lses = [torch.empty_like(lse_p) for _ in range(world)]
    dist.all_gather(outs, out_p.contiguous(), group=group)
    dist.all_gather(lses, lse_p.contiguous(), group=group)
    out, lse = _merge_all(parts, outs, lses)
    if replicated:
        return out, lse
    a = sum(rows[:rank])
    return out[:, a : a + rows[rank]], lse[:, :, a : a + rows[rank]]


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    positions: Sequence[torch.Tensor],
    q_positions: Sequence[torch.Tensor],
    replicated: bool = False,
    group: Any = None,
    mask: MaskSpec = NO_MASK,
    softmax_scale: float | None = None,
    form: str = "all-gather",
    softcap: float | None = None,
    alibi_slopes: Sequence[float] | torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    pages: PagedKV | None = None,
    parts: RingParts = REFERENCE_PARTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, float32 lse (B, Hq, Lq)) of this rank's queries over every rank's KV.

    `positions[r]`: rank r's KV positions; `q_positions[r]`: rank r's query rows (all equal when
    `replicated`). `mask` is over global positions (within each request). `form`: all-gather or
    all-to-all merge. With `pages`, k and v are page pools (`ring_impl.paged`)."""
    if form not in FORMS:
        raise ValueError(f"unknown merge form {form!r}; expected one of {', '.join(FORMS)}")
    forward_only(q, k, v, "decode_attention")
    k, v = read_kv(k, v, pages)
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if initialised else 1
    rank = dist.get_rank(group) if initialised else 0
    scale = parts.scale(softmax_scale, q.shape[-1])
    variant = variant_of(q, softcap, alibi_slopes, sinks)
    rows = [int(p.numel()) for p in q_positions]
    if replicated:
        q_all, q_pos = q, q_positions[rank]
    else:
        q_all, q_pos = _gather_rows(q, rows, group), torch.cat(list(q_positions))
    q_pos, k_pos = q_pos.to(q.device), positions[rank].to(q.device)
    at = BlockAt(rank, rank, 0, world, "serving")
    out_p, lse_p = share_attention(parts, q_all, k, v, q_pos, k_pos, at, mask, scale, variant)
    if world == 1:
        out, lse = out_p, lse_p
    elif form == "all-gather":
        out, lse = _merged_all_gather(parts, out_p, lse_p, rows, replicated, rank, group)
    else:
        out, lse = _merged_all_to_all(parts, out_p, lse_p, rows, replicated, rank, group)
    if sinks is not None:
        out, lse = parts.merge(out, lse, torch.zeros_like(out), sink_lse(sinks.detach(), lse))
    return out.to(q.dtype), lse.float()
