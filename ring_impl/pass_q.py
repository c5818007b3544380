"""Reference pass-Q ring for prefill onto a KV cache: the queries travel, the cache stays put.

The context-parallel inference paper that torch's CP cites (arXiv 2411.01783) runs prefill as a
ring in two forms. Pass-KV is `ring_impl.ring` with queries apart from keys. Pass-Q moves the few
new tokens instead of the long cache:

1. each rank holds its own query rows and its share of the KV cache;
2. at step s, rank r holds the query block of owner (r - s) mod W and that block's partial
   (out, lse) so far; it attends the block to its own KV share and merges (`ring_impl.merge`);
3. it sends the block and its partial on to the next rank and receives the next block; after W
   steps every block has met every share, and one more hop of (out, lse) takes it home.

The sink joins each row once, at home, after the last merge. Forward only, as prefill runs. A
rank with no visible key for a block's row gives it lse -inf, which the merge weighs 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ring_impl.comm import LocalComm, RingComm, ring_peers
from ring_impl.decode import forward_only, share_attention
from ring_impl.masks import MaskSpec
from ring_impl.paged import PagedKV, read_kv
from ring_impl.parts import REFERENCE_PARTS, BlockAt, RingParts
from ring_impl.plan import NO_MASK, variant_of
from ring_impl.variants import sink_lse

Q_TAG, PARTIAL_TAG = 2, 3


def _hop(comm: RingComm, tensors: Sequence[torch.Tensor], shapes: Sequence[tuple]) -> list:
    """Send `tensors` to the next rank and receive tensors of `shapes` from the previous one."""
    got = [
        torch.empty(s, dtype=t.dtype, device=t.device) for t, s in zip(tensors, shapes, strict=True)
    ]
    for t, g in zip(tensors, got, strict=True):
        comm.exchange(t.contiguous(), g)
    comm.wait()
    return got


def pass_q_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    positions: Sequence[torch.Tensor],
    q_positions: Sequence[torch.Tensor],
    group: Any = None,
    mask: MaskSpec = NO_MASK,
    softmax_scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: Sequence[float] | torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    pages: PagedKV | None = None,
    parts: RingParts = REFERENCE_PARTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, float32 lse (B, Hq, Lq)) of this rank's query rows over every rank's KV.

    `positions[r]`: rank r's KV positions; `q_positions[r]`: rank r's query rows. `mask` is over
    global positions (within each request). With `pages`, k and v are page pools."""
    forward_only(q, k, v, "pass_q_attention")
    k, v = read_kv(k, v, pages)
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if initialised else 1
    rank = dist.get_rank(group) if initialised else 0
    scale = parts.scale(softmax_scale, q.shape[-1])
    variant = variant_of(q, softcap, alibi_slopes, sinks)
    k_pos = positions[rank].to(q.device)
    comm = LocalComm() if world == 1 else RingComm(group, ring_peers(group, rank, world), Q_TAG)
    block, out, lse = q, None, None
    b, _, h, dv = q.shape[0], None, q.shape[2], v.shape[-1]
    for step in range(world):
        owner = (rank - step) % world
        q_pos = q_positions[owner].to(q.device)
        at = BlockAt(rank, rank, step, world, "serving")
        o, s = share_attention(parts, block, k, v, q_pos, k_pos, at, mask, scale, variant)
        out, lse = (o, s) if out is None else parts.merge(out, lse, o, s)
        nxt = q_positions[(owner - 1) % world].numel()
        shapes = [(b, nxt, h, q.shape[3]), (b, nxt, h, dv), (b, h, nxt)]
        if step + 1 < world:
            block, out, lse = _hop(comm, (block, out, lse), shapes)
    if world > 1:  # home: the block held now is the next rank's
        mine = q_positions[rank].numel()
        out, lse = _hop(comm, (out, lse), [(b, mine, h, dv), (b, h, mine)])
    comm.close()
    if sinks is not None:
        out, lse = parts.merge(out, lse, torch.zeros_like(out), sink_lse(sinks.detach(), lse))
    return out.to(q.dtype), lse.float()
