"""The replaceable pieces of the reference ring, and their reference choices (`REFERENCE_PARTS`).

Each piece is a plain function. A bug variant (mutant) replaces one or two with
`dataclasses.replace`. `ring_impl.ring` runs the ring from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ring_impl import layouts, variants
from ring_impl.comm import RingComm, RingPeers, ring_peers
from ring_impl.kernel import block_backward, block_forward, gqa_kv_heads
from ring_impl.mask_eval import FULL, SKIP, allowed, block_decision
from ring_impl.masks import MaskSpec
from ring_impl.merge import merge
from ring_impl.variants import Scores, Variant


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


def global_scores(
    variant: Variant, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt, scale: float
) -> Scores | None:
    """The block's score function (softcap, ALiBi) from the global positions of its queries and
    keys: the same bias wherever the keys live. The kernel hands it scores already scaled."""
    return Scores.of(variant, q_pos, k_pos)


def once(world_size: int) -> int:
    """How many times the sink joins each row's softmax: once, wherever the row's keys live."""
    return 1


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
    queries sees any key; block_scores: a block's score function (softcap, ALiBi); sink_folds: how
    often the sink joins a row's softmax; sink_grad: the sink's gradient from the rows' lse and D.
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
    block_scores: Callable[[Variant, torch.Tensor, torch.Tensor, BlockAt, float], Scores | None] = (
        global_scores
    )
    sink_folds: Callable[[int], int] = once
    sink_grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
        variants.sink_grad
    )


REFERENCE_PARTS = RingParts()
