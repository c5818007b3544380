"""Build a mutant: the reference ring with a few RingParts replaced."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ring_impl.masks import MaskSpec
from ring_impl.ring import REFERENCE_PARTS, BlockAt, make_ring_attention

MaskFn = Callable[[MaskSpec, torch.Tensor, torch.Tensor, BlockAt], "torch.Tensor | None"]


def mutant(name: str, doc: str, **changes: Any) -> Callable[..., Any]:
    """A `ring_attention`-compatible function running REFERENCE_PARTS with `changes` applied."""
    fn = make_ring_attention(dataclasses.replace(REFERENCE_PARTS, **changes))
    fn.__name__ = fn.__qualname__ = name.replace("-", "_")
    fn.__doc__ = doc
    return fn


def mask_changes(block_mask: MaskFn) -> dict[str, Any]:
    """Replace the block mask, skipping exactly the blocks that mask leaves empty (no hidden
    skips)."""

    def skip(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt) -> bool:
        if q_pos.numel() == 0 or k_pos.numel() == 0:
            return True
        m = block_mask(spec, q_pos, k_pos, at)
        return m is not None and not bool(m.any())

    return {"block_mask": block_mask, "skip_block": skip}
