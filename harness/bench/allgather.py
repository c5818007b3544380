"""Baseline for the speed figure: all-gather context-parallel attention (Megatron/llama3 style).

Each rank all-gathers every rank's K/V (one collective, padded to the longest shard), attends its
queries to the whole sequence in one block with the reference kernel and the same position masks,
and in backward reduce-scatters the K/V gradients back to their owners. Differentiable, exact (it
is judged like any implementation), and O(n) memory per rank by design: the comparison point for
the ring's O(n/W).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.context import Capabilities, Impl, RunContext
from ring_impl.kernel import block_backward, block_forward
from ring_impl.mask_eval import allowed


def _gather(x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """(W, *x.shape) of every rank's x, padded to the longest shard along dim 2 (the tokens)."""
    lmax = max(ctx.lengths)
    pad = x.new_zeros(x.shape[:2] + (lmax,) + x.shape[3:])
    pad[:, :, : x.shape[2]] = x
    # ranks stacked along dim 0
    out = x.new_empty((ctx.world_size * pad.shape[0],) + tuple(pad.shape[1:]))
    if ctx.world_size == 1:
        out.copy_(pad)
    else:
        dist.all_gather_into_tensor(out, pad, group=ctx.group)
    return out.view((ctx.world_size,) + tuple(pad.shape))


def _unpad(g: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """(2, B, n, H, D): every owner's tokens in owner order (matching cat(all_positions))."""
    return torch.cat([g[r, :, :, :n] for r, n in enumerate(ctx.lengths)], dim=2)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, q, k, v, ctx: RunContext):
        kv = _unpad(_gather(torch.stack((k, v)), ctx), ctx)
        k_pos = torch.cat(list(ctx.all_positions))
        mask = allowed(ctx.mask, ctx.positions, k_pos)
        out, lse = block_forward(q, kv[0], kv[1], ctx.softmax_scale, mask)
        fctx.save_for_backward(q, kv, out, lse)
        fctx.mask, fctx.rctx = mask, ctx
        lse = lse.float()
        fctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(fctx: Any, dout, _dlse):
        q, kv, out, lse = fctx.saved_tensors
        ctx: RunContext = fctx.rctx
        dq, dk, dv = block_backward(dout, q, kv[0], kv[1], out, lse, ctx.softmax_scale, fctx.mask)
        lmax = max(ctx.lengths)
        grads = dk.new_zeros((ctx.world_size, 2) + dk.shape[:1] + (lmax,) + dk.shape[2:])
        start = 0
        for r, n in enumerate(ctx.lengths):
            grads[r, 0, :, :n] = dk[:, start : start + n]
            grads[r, 1, :, :n] = dv[:, start : start + n]
            start += n
        mine = grads.new_empty(grads.shape[1:])
        if ctx.world_size == 1:
            mine.copy_(grads[0])
        else:
            dist.reduce_scatter_tensor(
                mine, grads.view((-1,) + tuple(grads.shape[2:])), group=ctx.group
            )
        n = ctx.lengths[ctx.rank]
        dtype = q.dtype
        return dq.to(dtype), mine[0, :, :n].to(dtype), mine[1, :, :n].to(dtype), None


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext):
    """(out, lse) of the local queries over the all-gathered sequence."""
    return _AllGatherAttention.apply(q, k, v, ctx)


def impl() -> Impl:
    """`harness.bench.allgather:impl`: the all-gather baseline as a harness implementation."""
    return Impl(
        name="allgather-cp", run=run, capabilities=Capabilities(returns_lse=True), version="bench"
    )
