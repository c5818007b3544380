"""Implementations for the fault-injection tests (loaded as tests.helpers.fault_impls:NAME).

`read_before_wait` and `send_buffer_overwrite` adapt the planted mutants of ring_impl.mutants; the
all-gather variants and the `tour` exercise the collective interposition; `hang_pending` hangs with
an unmatched receive in flight (for the hang report's pending ops).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from harness.context import Impl
from ring_impl.mutants import MUTANTS
from ring_impl.ring import REFERENCE_PARTS, make_ring_attention


def _adapt(fn) -> object:
    def run(q, k, v, ctx):
        return fn(
            q,
            k,
            v,
            group=ctx.group,
            layout=ctx.layout,
            lengths=ctx.lengths,
            mask=ctx.mask,
            softmax_scale=ctx.softmax_scale,
            return_lse=True,
        )

    return run


def _gathered(t: torch.Tensor, ctx, wait_first: bool) -> torch.Tensor:
    """All ranks' shards of t (padded to the longest), concatenated in rank order."""
    n = max(ctx.lengths)
    pad = torch.zeros(t.shape[0], n, *t.shape[2:], dtype=t.dtype)
    pad[:, : t.shape[1]] = t
    outs = [torch.empty_like(pad) for _ in range(ctx.world_size)]
    work = dist.all_gather(outs, pad, group=ctx.group, async_op=True)
    if wait_first:
        work.wait()
    full = torch.cat([o[:, :m] for o, m in zip(outs, ctx.lengths, strict=True)], dim=1).clone()
    if not wait_first:
        work.wait()
    return full


def _allgather_run(wait_first: bool):
    """Attention over all-gathered K/V (positions reordered to match), contiguous layout only."""
    from ring_impl.mask_eval import allowed

    def run(q, k, v, ctx):
        kf = _GatherFn.apply(k, ctx, wait_first)
        vf = _GatherFn.apply(v, ctx, wait_first)
        kpos = torch.cat(list(ctx.all_positions))
        mask = allowed(ctx.mask, ctx.positions, kpos)
        rep = q.shape[2] // k.shape[2]
        kf, vf = kf.repeat_interleave(rep, dim=2), vf.repeat_interleave(rep, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, kf) * ctx.softmax_scale
        if mask is not None:
            s = s.masked_fill(~mask.view(1, 1, *mask.shape), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        return torch.einsum("bhqk,bkhd->bqhd", p, vf)

    return run


class _GatherFn(torch.autograd.Function):
    """all_gather forward; backward sums each rank's gradient slice back with all_reduce."""

    @staticmethod
    def forward(ctx_, t, ctx, wait_first):
        ctx_.ring = ctx
        return _gathered(t, ctx, wait_first)

    @staticmethod
    def backward(ctx_, grad):
        ctx = ctx_.ring
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.lengths[: ctx.rank])
        return grad[:, start : start + ctx.lengths[ctx.rank]].clone(), None, None


reference_parts = Impl("tests-reference-parts", _adapt(make_ring_attention(REFERENCE_PARTS)))
read_before_wait = Impl("mutant-read-before-wait", _adapt(MUTANTS["read-before-wait"]))
send_buffer_overwrite = Impl(
    "mutant-send-buffer-overwrite", _adapt(MUTANTS["send-buffer-overwrite"])
)
allgather = Impl("tests-allgather", _allgather_run(wait_first=True))
allgather_read_early = Impl("tests-allgather-read-early", _allgather_run(wait_first=False))


def _expect(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        raise AssertionError(f"{name}: got {got.tolist()}, want {want.tolist()}")


def _tour_ops(ctx, read_early: bool) -> torch.Tensor:
    """One of every wrapped operation, async ones waited before their data is checked; returns a
    value read before the first wait (NaN under early-read) when `read_early`."""
    g, w, r = ctx.group, ctx.world_size, ctx.rank
    nxt, prv = ctx.global_ranks[(r + 1) % w], ctx.global_ranks[(r - 1) % w]
    f32 = torch.float32
    t = torch.full((3,), float(r + 1))
    work = dist.all_reduce(t, group=g, async_op=True)
    early = t.sum() * 0 if read_early else torch.zeros(())
    work.wait()
    _expect("all_reduce", t, torch.full((3,), float(w * (w + 1) // 2)))
    outs = [torch.empty(2) for _ in range(w)]
    dist.all_gather(outs, torch.full((2,), float(r)), group=g, async_op=True).wait()
    _expect("all_gather", torch.cat(outs), torch.arange(w, dtype=f32).repeat_interleave(2))
    out = torch.empty(2 * w)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r)), group=g, async_op=True).wait()
    _expect("all_gather_into_tensor", out, torch.arange(w, dtype=f32).repeat_interleave(2))
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=ctx.global_ranks[0], group=g, async_op=True).wait()
    _expect("broadcast", b, torch.zeros(2))
    o = torch.empty(w)
    dist.all_to_all_single(
        o, torch.tensor([float(r * w + j) for j in range(w)]), group=g, async_op=True
    ).wait()
    _expect("all_to_all_single", o, torch.tensor([float(j * w + r) for j in range(w)]))
    o1 = torch.empty(1)
    dist.reduce_scatter_tensor(o1, torch.arange(w, dtype=f32), group=g, async_op=True).wait()
    _expect("reduce_scatter_tensor", o1, torch.tensor([float(w * r)]))
    _rooted_ops(ctx)
    dist.barrier(group=g)
    buf = torch.empty(2)
    if r % 2 == 0:
        dist.send(torch.full((2,), float(r)), nxt, group=g)
        dist.recv(buf, prv, group=g)
    else:
        dist.recv(buf, prv, group=g)
        dist.send(torch.full((2,), float(r)), nxt, group=g)
    _expect("send/recv", buf, torch.full((2,), float((r - 1) % w)))
    buf2 = torch.empty(2)
    ops = [
        dist.P2POp(dist.isend, torch.full((2,), float(r)), nxt, group=g),
        dist.P2POp(dist.irecv, buf2, prv, group=g),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    _expect("batch_isend_irecv", buf2, torch.full((2,), float((r - 1) % w)))
    return early


def _rooted_ops(ctx) -> None:
    """scatter, gather and reduce with group rank 0 as the root, async, waited, then checked."""
    g, w, r = ctx.group, ctx.world_size, ctx.rank
    root = ctx.global_ranks[0]
    f32 = torch.float32
    part = torch.empty(2)
    chunks = [torch.full((2,), float(j)) for j in range(w)] if r == 0 else None
    dist.scatter(part, chunks, src=root, group=g, async_op=True).wait()
    _expect("scatter", part, torch.full((2,), float(r)))
    got = [torch.empty(1) for _ in range(w)] if r == 0 else None
    dist.gather(torch.full((1,), float(r)), got, dst=root, group=g, async_op=True).wait()
    if r == 0:
        _expect("gather", torch.cat(got), torch.arange(w, dtype=f32))
    red = torch.full((1,), float(r + 1))
    dist.reduce(red, dst=root, group=g, async_op=True).wait()
    if r == 0:
        _expect("reduce", red, torch.tensor([float(w * (w + 1) // 2)]))


def _tour(read_early: bool):
    ring = _adapt(make_ring_attention(REFERENCE_PARTS))

    def run(q, k, v, ctx):
        early = _tour_ops(ctx, read_early)
        out, lse = ring(q, k, v, ctx)
        return out + early.to(out.dtype), lse

    return run


def _hang_pending(q, k, v, ctx):
    """Posts a receive nobody sends, blocks once in a barrier (completes), then hangs in Python."""
    dist.irecv(
        torch.empty(4),
        src=ctx.global_ranks[(ctx.rank - 1) % ctx.world_size],
        group=ctx.group,
        tag=7,
    )
    dist.barrier(group=ctx.group)
    time.sleep(3600)


tour = Impl("tests-tour", _tour(read_early=False))
tour_read_early = Impl("tests-tour-read-early", _tour(read_early=True))
hang_pending = Impl("tests-hang-pending", _hang_pending)
