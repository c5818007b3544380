"""Reference ring attention: a real K/V ring with overlapped, double-buffered P2P, forward and
backward.

Each rank holds only its own Q/K/V shard. At step s rank r holds the K/V of owner (r - s) mod W,
computes that block while the next one is in flight, and merges the partial results. Backward runs
its own ring: dq stays local, the dk/dv accumulators travel with K/V and make one more hop home.

The ring is assembled from `RingParts`, a frozen dataclass of small plain functions. The reference
is `REFERENCE_PARTS`; a bug variant (mutant) replaces one or two fields with `dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ring_impl.buffers import DoubleBuffer
from ring_impl.masks import MaskSpec
from ring_impl.paged import PagedKV, read_kv
from ring_impl.parts import (  # noqa: F401 - the pieces, re-exported for the mutants
    REFERENCE_PARTS,
    BlockAt,
    KVBlock,
    RingParts,
    position_mask,
    skip_empty_block,
)
from ring_impl.plan import NO_MASK, RingPlan, plan_call, variant_of  # noqa: F401
from ring_impl.variants import sink_lse

KV_TAG = 0
DKV_TAG = 1


def _kv_ring(
    parts: RingParts, plan: RingPlan, k: torch.Tensor, v: torch.Tensor
) -> Iterator[tuple[int, int, tuple[torch.Tensor, ...]]]:
    """Yield (step, owner, (k, v)) for each ring step while the next block is already in flight.

    The transfer is posted before the current block is handed out and waited after it is used;
    one slot is sent while the other is received into.
    """
    comm = plan.channel(parts, KV_TAG)
    buf = DoubleBuffer(plan.kv_shapes(k, v), k.dtype, k.device)
    buf.load(0, plan.rank, k, v)
    steps, slot = parts.steps(plan.world_size), 0
    for step in range(steps):
        owner = (plan.rank - step) % plan.world_size
        more = step + 1 < steps
        if more:
            comm.exchange(buf.flat(slot, owner), buf.flat(1 - slot, (owner - 1) % plan.world_size))
        yield step, owner, buf.views(slot, owner)
        if more:
            comm.wait()
            slot = 1 - slot
    comm.close()


def ring_forward(
    parts: RingParts,
    plan: RingPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (out, lse) of the local queries over every rank's keys, in the accumulator dtype.

    A sink joins each row once, after the last block: a merge with out 0 and lse sink_h.
    """
    acc = parts.acc_dtype(q.dtype)
    out = lse = None
    for step, owner, (k_j, v_j) in _kv_ring(parts, plan, k, v):
        skip, mask = plan.block_mask(parts, step, owner, q)
        if skip:
            continue
        block_out, block_lse = parts.block_forward(
            q,
            k_j,
            v_j,
            plan.scale,
            mask,
            kv_heads=parts.kv_heads,
            **_scored(plan, parts, step, owner),
        )
        block_out, block_lse = block_out.to(acc), block_lse.to(acc)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out, lse = parts.merge(out, lse, block_out, block_lse)
    if out is None:  # no query sees any key (or this rank holds no token)
        out, lse = parts.no_blocks(q, v, acc)
    if sinks is not None:
        for _ in range(parts.sink_folds(plan.world_size)):
            out, lse = parts.merge(out, lse, torch.zeros_like(out), sink_lse(sinks, lse))
    return out, lse


def _scored(plan: RingPlan, parts: RingParts, step: int, owner: int) -> dict:
    """The kernel's `scores` argument for a block: none for plain attention (the kernels of the
    mutants that predate the variants take no such argument)."""
    fn = plan.scores(parts, step, owner)
    return {} if fn is None else {"scores": fn}


def ring_backward(
    parts: RingParts,
    plan: RingPlan,
    dout: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 (dq, dk, dv): dq accumulates locally, dk/dv accumulators ride the ring home."""
    q, k, v, out, lse = saved
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    comm = plan.channel(parts, DKV_TAG)
    dkv = DoubleBuffer(plan.kv_shapes(k, v), torch.float32, k.device)
    local = KVBlock(k, v, plan.rank)
    hops, done, held, slot = parts.dkv_hops(plan.world_size), 0, plan.rank, 0

    def hop() -> None:
        nonlocal done, held, slot
        comm.exchange(dkv.flat(slot, held), dkv.flat(1 - slot, (held - 1) % plan.world_size))
        done, held, slot = done + 1, (held - 1) % plan.world_size, 1 - slot

    for step, owner, (k_j, v_j) in _kv_ring(parts, plan, k, v):
        block = parts.backward_kv(KVBlock(k_j, v_j, owner), local)
        skip, mask = plan.block_mask(parts, step, block.owner, q)
        grads = None
        if not skip:
            grads = parts.block_backward(
                dout,
                q,
                block.k,
                block.v,
                out,
                lse,
                plan.scale,
                mask,
                kv_heads=parts.kv_heads,
                **_scored(plan, parts, step, block.owner),
            )
        if step > 0:
            comm.wait()  # the accumulator of this step's owner has arrived
        dk_acc, dv_acc = dkv.views(slot, held)
        if step == 0:
            dk_acc.zero_()
            dv_acc.zero_()
        if grads is not None:
            dq += grads[0]
            dk_acc += grads[1]
            dv_acc += grads[2]
        if done < hops:
            hop()
    comm.wait()
    while done < hops:
        hop()
        comm.wait()
    comm.close()
    dk, dv = dkv.views(slot, held)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """Ring attention forward/backward; saves only the local q, k, v, out and lse (and sinks)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, parts: RingParts, plan: RingPlan):
        out, lse = ring_forward(parts, plan, q, k, v, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.parts, ctx.plan = parts, plan
        lse_out = lse.float()
        ctx.mark_non_differentiable(lse_out)
        return out.to(q.dtype), lse_out

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.parts, ctx.plan, dout, (q, k, v, out, lse))
        parts = ctx.parts
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            delta = (dout.float() * out.float()).sum(dim=-1).transpose(1, 2)  # (B, Hq, L)
            dsinks = parts.sink_grad(sinks, lse.float(), delta).to(sinks.dtype)
        return (
            parts.cast_dq(dq, q.dtype),
            dk.to(k.dtype, copy=True),
            dv.to(v.dtype, copy=True),
            dsinks,
            None,
            None,
        )


def make_ring_attention(
    parts: RingParts = REFERENCE_PARTS, forward_only: bool = False
) -> Callable[..., Any]:
    """A function with the `ring_attention` signature that runs the ring built from `parts`.
    `forward_only`: the forward alone, without autograd (what context-parallel prefill runs); its
    output has no gradient."""

    def ring_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        group: Any = None,
        layout: str = "contiguous",
        lengths: Sequence[int] | None = None,
        mask: MaskSpec = NO_MASK,
        softmax_scale: float | None = None,
        return_lse: bool = False,
        softcap: float | None = None,
        alibi_slopes: Sequence[float] | torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        positions: Sequence[torch.Tensor] | None = None,
        q_positions: torch.Tensor | None = None,
        pages: PagedKV | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of the local query shard over the whole (sharded) sequence.

        q (B, L_local, Hq, D), k (B, L_local, Hkv, D), v (B, L_local, Hkv, Dv) are this rank's
        shards; `lengths` are all ranks' local lengths (None: all equal). Returns out in the input
        dtype (and float32 lse (B, Hq, L_local) with return_lse). The variants (docs/case-model.md):
        `softcap`, `alibi_slopes` (one per query head, from global positions) and `sinks` (one
        learnable logit per query head; its gradient comes back through autograd).
        An inference shape (pass-KV prefill onto a cache): `positions`, every rank's KV positions,
        and `q_positions`, this rank's query rows, replace the layout's; q then has its own length.
        With `pages`, k and v are page pools of a paged KV cache (`ring_impl.paged`).
        """
        k, v = read_kv(k, v, pages)
        plan, k, v = plan_call(
            parts,
            q,
            k,
            v,
            group=group,
            layout=layout,
            lengths=lengths,
            mask=mask,
            softmax_scale=softmax_scale,
            variant=variant_of(q, softcap, alibi_slopes, sinks),
            positions=positions,
            q_positions=q_positions,
        )
        if forward_only:
            with torch.no_grad():
                out, lse = ring_forward(parts, plan, q, k, v, sinks)
            out, lse = out.to(q.dtype), lse.float()
        else:
            out, lse = _RingAttention.apply(q, k, v, sinks, parts, plan)
        return (out, lse) if return_lse else out

    return ring_attention


ring_attention = make_ring_attention(REFERENCE_PARTS)
ring_attention_forward = make_ring_attention(REFERENCE_PARTS, forward_only=True)
