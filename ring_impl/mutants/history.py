"""Mutants whose result depends on what ran before in the same process (issue #19): state cached
across calls. A fresh process computes the first call exactly; only a later call is wrong, so a
single case replayed on fresh ranks does not reproduce them; a sequence of cases does."""

from __future__ import annotations

import torch

from ring_impl.kernel import block_backward
from ring_impl.mutants.base import mutant
from ring_impl.ring import KVBlock

# the leftover dk/dv per (rank, shape of the block): module-level, so it outlives a call, never
# zeroed
_CACHE: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}


class _Own:
    """Whether the block backward is computing now is this rank's own (ring step 0), and the
    rank."""

    rank: int = 0
    own: bool = False


def note_own_block(held: KVBlock, local: KVBlock) -> KVBlock:
    """The reference's block choice; notes whether it is this rank's own block (step 0) and the
    rank."""
    _Own.rank, _Own.own = local.owner, held.owner == local.owner
    return held


def cached_accumulator_backward(dout, q, k, v, *args, **kwargs):
    """The block's gradients; on this rank's own block the dk/dv accumulator is taken from a
    cache keyed by rank and shape that keeps what earlier calls accumulated into it (it is never
    zeroed)."""
    dq, dk, dv = block_backward(dout, q, k, v, *args, **kwargs)
    if not _Own.own:
        return dq, dk, dv
    key = (_Own.rank, tuple(k.shape))
    old_k, old_v = _CACHE.get(key, (torch.zeros_like(dk), torch.zeros_like(dv)))
    new_k, new_v = old_k + dk, old_v + dv
    _CACHE[key] = (new_k, new_v)
    return dq, new_k, new_v


dkv_cache_not_zeroed = mutant(
    "dkv-cache-not-zeroed",
    """The dk/dv accumulator of the rank's own block comes from a module-level cache keyed by rank and
    shape and is never zeroed, so every call adds the gradients of the earlier calls with the same
    shapes (ring-flash-attention 22f0e1d: "dkv_buffer was not zeroed"). Visible on the second call in
    the same process with the same shapes (the repeat check; in a masked case, its own leak run); the
    first call on fresh ranks is exact, so its witness is a sequence case.""",
    backward_kv=note_own_block,
    block_backward=cached_accumulator_backward,
)
