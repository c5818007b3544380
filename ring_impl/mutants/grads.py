"""Mutants in the backward ring: where dk/dv end up, which K/V are used, how dq is cast."""

from __future__ import annotations

import torch

from ring_impl.mutants.base import mutant
from ring_impl.ring import KVBlock


def local_block(held: KVBlock, local: KVBlock) -> KVBlock:
    """Backward recomputes every step against the K/V saved at step 0 (this rank's own)."""
    return local


dkv_no_final_hop = mutant(
    "dkv-no-final-hop",
    """dk/dv accumulators make only W - 1 hops (with K/V) and never the final hop home, so each rank
    returns the accumulator of rank + 1 (lucidrains ring-attention-pytorch cfb1990). Visible with
    W >= 2 (shape error when shard lengths differ).""",
    dkv_hops=lambda world_size: world_size - 1,
)

dkv_one_rank_off = mutant(
    "dkv-one-rank-off",
    """dk/dv accumulators make one hop too many and arrive one rank off: rank r returns the gradient
    of rank r - 1's keys (the other direction of lucidrains ring-attention-pytorch cfb1990's hop
    count). Visible with W >= 2 (shape error when shard lengths differ).""",
    dkv_hops=lambda world_size: world_size + 1,
)

stale_kv_backward = mutant(
    "stale-kv-backward",
    """Backward uses the K/V saved at ring step 0 on every step instead of the rotated blocks
    (diffusers #14265: TemplatedRingAttention reads ctx.saved_tensors from iteration 0). Visible
    with W >= 2 (shape error when shard lengths differ).""",
    backward_kv=local_block,
)

dq_through_bf16 = mutant(
    "dq-through-bf16",
    """Casts dq through bfloat16 whatever the input dtype (ring-flash-attention). Visible for fp32
    and fp16 inputs at any W.""",
    cast_dq=lambda grad, dtype: grad.to(torch.bfloat16).to(dtype),
)
