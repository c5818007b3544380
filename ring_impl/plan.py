"""One call of the ring, planned: its group, ranks, global positions, mask, scale and variant.

`plan_call` checks a call's inputs and builds its `RingPlan`. `ring_impl.ring` runs the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ring_impl.comm import LocalComm, RingComm, RingPeers
from ring_impl.kernel import TileMask, needs_tiles
from ring_impl.masks import MaskSpec
from ring_impl.parts import BlockAt, RingParts
from ring_impl.variants import PLAIN, Scores, Variant

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NO_MASK = MaskSpec()


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
    variant: Variant = PLAIN

    def scores(self, parts: RingParts, step: int, owner: int) -> Scores | None:
        """The score function of this rank's queries against owner's keys (None: plain)."""
        if self.variant.plain:
            return None
        at = BlockAt(self.rank, owner, step, self.world_size, self.layout)
        return parts.block_scores(self.variant, self.q_pos, self.k_pos[owner], at, self.scale)

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

    def kv_shapes(self, k: torch.Tensor, v: torch.Tensor) -> list[tuple[tuple[int, ...], ...]]:
        """The shapes of every owner's K and V blocks (V's head dim may be its own)."""
        b, _, h, d = k.shape
        return [((b, p.numel(), h, d), (b, p.numel(), h, v.shape[3])) for p in self.k_pos]

    def channel(self, parts: RingParts, tag: int) -> RingComm:
        """A ring channel: real P2P for W > 1, a local copy for a single rank."""
        return LocalComm() if self.world_size == 1 else parts.comm(self.group, self.peers, tag)


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


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, own_queries: bool = True
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, seq, heads, dim); got {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree on batch, length and heads; got {k.shape} and {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must agree on batch and head_dim; got {q.shape} and {k.shape}")
    if own_queries and q.shape[1] != k.shape[1]:
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
    variant: Variant = PLAIN,
    positions: Sequence[torch.Tensor] | None = None,
    q_positions: torch.Tensor | None = None,
) -> tuple[RingPlan, torch.Tensor, torch.Tensor]:
    """Check the inputs and plan one call: (plan, k, v), k and v cut to the K/V length the parts
    ride.

    `positions` (every rank's KV positions) and `q_positions` (this rank's query rows) replace the
    layout's: an inference shape, whose queries are not its keys (pass-KV prefill onto a cache)."""
    _check_inputs(q, k, v, own_queries=q_positions is None)
    group, rank, world_size = _group_rank_world(group)
    if positions is not None:
        lengths = [int(p.numel()) for p in positions]
    lengths = [k.shape[1]] * world_size if lengths is None else [int(n) for n in lengths]
    if len(lengths) != world_size:
        raise ValueError(f"lengths names {len(lengths)} ranks but the group has {world_size}")
    if lengths[rank] != k.shape[1]:
        raise ValueError(f"rank {rank} holds {k.shape[1]} tokens but lengths says {lengths[rank]}")
    every = parts.positions(layout, lengths) if positions is None else positions
    pos = [parts.position_values(p.to(q.device), q.dtype) for p in every]
    mine = (
        pos[rank]
        if q_positions is None
        else parts.position_values(q_positions.to(q.device), q.dtype)
    )
    if mine.numel() != q.shape[1]:
        raise ValueError(f"q holds {q.shape[1]} rows but its positions name {mine.numel()}")
    kv_len = parts.kv_lengths(lengths)
    if kv_len[rank] != k.shape[1]:
        k, v = k[:, : kv_len[rank]], v[:, : kv_len[rank]]
    plan = RingPlan(
        group=group,
        rank=rank,
        world_size=world_size,
        layout=layout,
        q_pos=mine,
        k_pos=tuple(p[:n] for p, n in zip(pos, kv_len, strict=True)),
        mask=mask,
        scale=parts.scale(softmax_scale, q.shape[-1]),
        peers=parts.peers(group, rank, world_size) if world_size > 1 else None,
        variant=variant,
    )
    return plan, k, v


def variant_of(q: torch.Tensor, softcap, alibi_slopes, sinks) -> Variant:
    """The call's variant from its arguments, checked: a sink and a slope per query head."""
    heads = q.shape[2]
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if t is not None and tuple(torch.as_tensor(t).shape) != (heads,):
            raise ValueError(f"{name} must hold one value per query head ({heads})")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    slopes = None if alibi_slopes is None else tuple(float(x) for x in alibi_slopes)
    return Variant(None if softcap is None else float(softcap), slopes)
