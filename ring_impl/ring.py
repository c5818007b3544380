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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ring_impl import layouts
from ring_impl.buffers import DoubleBuffer
from ring_impl.comm import LocalComm, RingComm, RingPeers, ring_peers
from ring_impl.kernel import TileMask, block_backward, block_forward, gqa_kv_heads, needs_tiles
from ring_impl.mask_eval import FULL, SKIP, allowed, block_decision
from ring_impl.masks import MaskSpec
from ring_impl.merge import merge

KV_TAG = 0
DKV_TAG = 1
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NO_MASK = MaskSpec()


@dataclass(frozen=True)
class BlockAt:
    """Where a block sits in the ring: this rank, the owner of its keys, the step, W and the
    layout."""

    rank: int
    owner: int
    step: int
    world_size: int
    layout: str


@dataclass(frozen=True)
class KVBlock:
    """A key/value block and the rank that owns it."""

    k: torch.Tensor
    v: torch.Tensor
    owner: int


def skip_empty_block(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt) -> bool:
    """Skip a block when no query may see any of its keys (decided by global positions only)."""
    return block_decision(spec, q_pos, k_pos) == SKIP


def position_mask(
    spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt
) -> torch.Tensor | None:
    """The block's mask from global positions; the same rule for every layout, step and split. None
    for a block every query of which sees every key (`block_decision` FULL: no mask to apply)."""
    if block_decision(spec, q_pos, k_pos) == FULL:
        return None
    return allowed(spec, q_pos, k_pos)


def nothing_seen(
    q: torch.Tensor, v: torch.Tensor, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of queries that see no key at all (every block skipped, or no token): out = 0, lse
    = -inf."""
    b, n, h, _ = q.shape
    return q.new_zeros(q.shape[:3] + (v.shape[-1],), dtype=acc), q.new_full(
        (b, h, n), float("-inf"), dtype=acc
    )


def given_or_default_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The caller's softmax scale, or 1/sqrt(head_dim)."""
    return float(softmax_scale) if softmax_scale is not None else head_dim**-0.5


def held_block(held: KVBlock, local: KVBlock) -> KVBlock:
    """Backward computes on the K/V block the ring delivered at this step."""
    return held


def float32_accumulator(dtype: torch.dtype) -> torch.dtype:
    """Partial out/lse are accumulated in float32 whatever the input dtype."""
    return torch.float32


def cast_grad(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 gradient to the input dtype, once, at the end."""
    return grad.to(dtype)


def exact_positions(pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Global positions stay integers whatever the input dtype (exact at every length)."""
    return pos


def whole_ring(world_size: int) -> int:
    """Ring steps (blocks per rank) and dk/dv hops: W, i.e. K/V make W - 1 hops and dk/dv W."""
    return world_size


@dataclass(frozen=True)
class RingParts:
    """The replaceable pieces of the ring, each a plain function (or class, for `comm`).

    positions: every rank's global positions; position_values: those positions as the ring computes
    with them, given the input dtype; kv_lengths: tokens of each rank's K/V that ride the ring;
    skip_block/block_mask: which blocks to compute and their masks; kv_heads: GQA head map; scale:
    softmax scale; block_forward/block_backward: the kernel; merge: combine partials; acc_dtype:
    dtype of the out/lse accumulators; peers: neighbours' global ranks; comm: the P2P channel;
    steps: blocks per rank; dkv_hops: hops of the dk/dv accumulators; backward_kv: the K/V backward
    computes on; cast_dq: dq to the input dtype; no_blocks: the (out, lse) of a rank none of whose
    queries sees any key.
    """

    positions: Callable[[str, Sequence[int]], list[torch.Tensor]] = layouts.all_positions
    position_values: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = exact_positions
    kv_lengths: Callable[[Sequence[int]], list[int]] = list
    skip_block: Callable[[MaskSpec, torch.Tensor, torch.Tensor, BlockAt], bool] = skip_empty_block
    block_mask: Callable[[MaskSpec, torch.Tensor, torch.Tensor, BlockAt], torch.Tensor | None] = (
        position_mask
    )
    kv_heads: Callable[[int, int], torch.Tensor] = gqa_kv_heads
    scale: Callable[[float | None, int], float] = given_or_default_scale
    block_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] = block_forward
    block_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = block_backward
    merge: Callable[..., tuple[torch.Tensor, torch.Tensor]] = merge
    acc_dtype: Callable[[torch.dtype], torch.dtype] = float32_accumulator
    peers: Callable[[Any, int, int], RingPeers] = ring_peers
    comm: Callable[[Any, RingPeers, int], RingComm] = RingComm
    steps: Callable[[int], int] = whole_ring
    dkv_hops: Callable[[int], int] = whole_ring
    backward_kv: Callable[[KVBlock, KVBlock], KVBlock] = held_block
    cast_dq: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = cast_grad
    no_blocks: Callable[
        [torch.Tensor, torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]
    ] = nothing_seen


REFERENCE_PARTS = RingParts()


@dataclass(frozen=True)
class RingPlan:
    """Everything one call needs besides tensors: group, ranks, global positions, mask and scale."""

    group: Any
    rank: int
    world_size: int
    layout: str
    q_pos: torch.Tensor
    k_pos: tuple[torch.Tensor, ...]
    mask: MaskSpec
    scale: float
    peers: RingPeers | None

    def block_mask(
        self, parts: RingParts, step: int, owner: int, q: torch.Tensor | None = None
    ) -> tuple[bool, torch.Tensor | TileMask | None]:
        """(skip, mask) for this rank's queries against owner's keys at `step`. For a block larger
        than the kernel's tile (given the queries `q`), the mask is a `TileMask`: `parts.block_mask`
        on each tile's positions, so no (Lq, Lk) mask is built."""
        at = BlockAt(self.rank, owner, step, self.world_size, self.layout)
        q_pos, k_pos = self.q_pos, self.k_pos[owner]
        if parts.skip_block(self.mask, q_pos, k_pos, at):
            return True, None
        if q is not None and needs_tiles(
            q.shape[0], q.shape[2], q_pos.numel(), k_pos.numel(), q.device
        ):
            fn, spec = parts.block_mask, self.mask
            return False, TileMask(
                lambda qs, ks: fn(spec, q_pos[qs], k_pos[ks], at), (q_pos.numel(), k_pos.numel())
            )
        return False, parts.block_mask(self.mask, q_pos, k_pos, at)

    def kv_shapes(self, k: torch.Tensor) -> list[tuple[int, ...]]:
        """Shape of every owner's K (and V) block."""
        return [(k.shape[0], p.numel(), k.shape[2], k.shape[3]) for p in self.k_pos]

    def channel(self, parts: RingParts, tag: int) -> RingComm:
        """A ring channel: real P2P for W > 1, a local copy for a single rank."""
        return LocalComm() if self.world_size == 1 else parts.comm(self.group, self.peers, tag)


def _kv_ring(
    parts: RingParts, plan: RingPlan, k: torch.Tensor, v: torch.Tensor
) -> Iterator[tuple[int, int, tuple[torch.Tensor, ...]]]:
    """Yield (step, owner, (k, v)) for each ring step while the next block is already in flight.

    The transfer is posted before the current block is handed out and waited after it is used;
    one slot is sent while the other is received into.
    """
    comm = plan.channel(parts, KV_TAG)
    buf = DoubleBuffer(plan.kv_shapes(k), 2, k.dtype, k.device)
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
    parts: RingParts, plan: RingPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (out, lse) of the local queries over every rank's keys, in the accumulator dtype."""
    acc = parts.acc_dtype(q.dtype)
    out = lse = None
    for step, owner, (k_j, v_j) in _kv_ring(parts, plan, k, v):
        skip, mask = plan.block_mask(parts, step, owner, q)
        if skip:
            continue
        block_out, block_lse = parts.block_forward(
            q, k_j, v_j, plan.scale, mask, kv_heads=parts.kv_heads
        )
        block_out, block_lse = block_out.to(acc), block_lse.to(acc)
        if out is None:
            out, lse = block_out, block_lse
        else:
            out, lse = parts.merge(out, lse, block_out, block_lse)
    if out is None:  # no query sees any key (or this rank holds no token)
        out, lse = parts.no_blocks(q, v, acc)
    return out, lse


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
    dkv = DoubleBuffer(plan.kv_shapes(k), 2, torch.float32, k.device)
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
                dout, q, block.k, block.v, out, lse, plan.scale, mask, kv_heads=parts.kv_heads
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
    """Ring attention forward/backward; saves only the local q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, parts: RingParts, plan: RingPlan):
        out, lse = ring_forward(parts, plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.plan = parts, plan
        lse_out = lse.float()
        ctx.mark_non_differentiable(lse_out)
        return out.to(q.dtype), lse_out

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.parts, ctx.plan, dout, (q, k, v, out, lse))
        parts = ctx.parts
        return (
            parts.cast_dq(dq, q.dtype),
            dk.to(k.dtype, copy=True),
            dv.to(v.dtype, copy=True),
            None,
            None,
        )


def _group_rank_world(group: Any) -> tuple[Any, int, int]:
    """(group, rank in group, group size); a single rank when torch.distributed is not
    initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return None, 0, 1
    group = dist.group.WORLD if group is None else group
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return group, rank, world_size


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, seq, heads, dim); got {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must agree on batch and head_dim; got {q.shape} and {k.shape}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and k/v shards must have the same length; got {q.shape[1]} and {k.shape[1]}"
        )
    if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ValueError(
            f"q, k, v must share one of fp32/fp16/bf16; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")


def plan_call(
    parts: RingParts,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    layout: str = "contiguous",
    lengths: Sequence[int] | None = None,
    mask: MaskSpec = NO_MASK,
    softmax_scale: float | None = None,
) -> tuple[RingPlan, torch.Tensor, torch.Tensor]:
    """Check the inputs and plan one call: (plan, k, v), k and v cut to the K/V length the parts
    ride."""
    _check_inputs(q, k, v)
    group, rank, world_size = _group_rank_world(group)
    lengths = [q.shape[1]] * world_size if lengths is None else [int(n) for n in lengths]
    if len(lengths) != world_size:
        raise ValueError(f"lengths names {len(lengths)} ranks but the group has {world_size}")
    if lengths[rank] != q.shape[1]:
        raise ValueError(f"rank {rank} holds {q.shape[1]} tokens but lengths says {lengths[rank]}")
    pos = [parts.position_values(p.to(q.device), q.dtype) for p in parts.positions(layout, lengths)]
    kv_len = parts.kv_lengths(lengths)
    if kv_len[rank] != k.shape[1]:
        k, v = k[:, : kv_len[rank]], v[:, : kv_len[rank]]
    plan = RingPlan(
        group=group,
        rank=rank,
        world_size=world_size,
        layout=layout,
        q_pos=pos[rank],
        k_pos=tuple(p[:n] for p, n in zip(pos, kv_len, strict=True)),
        mask=mask,
        scale=parts.scale(softmax_scale, q.shape[-1]),
        peers=parts.peers(group, rank, world_size) if world_size > 1 else None,
    )
    return plan, k, v


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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of the local query shard over the whole (sharded) sequence.

        q (B, L_local, Hq, D), k/v (B, L_local, Hkv, D) are this rank's shards; `lengths` are all
        ranks' local lengths (None: all equal). Returns out in the input dtype (and float32 lse
        (B, Hq, L_local) with return_lse).
        """
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
        )
        if forward_only:
            with torch.no_grad():
                out, lse = ring_forward(parts, plan, q, k, v)
            out, lse = out.to(q.dtype), lse.float()
        else:
            out, lse = _RingAttention.apply(q, k, v, parts, plan)
        return (out, lse) if return_lse else out

    return ring_attention


ring_attention = make_ring_attention(REFERENCE_PARTS)
ring_attention_forward = make_ring_attention(REFERENCE_PARTS, forward_only=True)
