"""Double buffers for blocks travelling the ring: one slot is sent while the other is received into.

A slot is one flat tensor big enough for the largest owner's block; the view for owner j is
exactly as long as j's block, so uneven shards need no padding on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class DoubleBuffer:
    """Two flat slots holding `parts` tensors of shape `shapes[owner]` each (e.g. k and v)."""

    def __init__(
        self,
        shapes: Sequence[tuple[int, ...]],
        parts: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shapes = [tuple(s) for s in shapes]
        self.parts = parts
        size = parts * max((math.prod(s) for s in self.shapes), default=0)
        self.slots = [torch.empty(size, dtype=dtype, device=device) for _ in range(2)]

    def flat(self, slot: int, owner: int) -> torch.Tensor:
        """The contiguous 1-D view that carries owner's block in `slot` (what goes on the wire)."""
        return self.slots[slot][: self.parts * math.prod(self.shapes[owner])]

    def views(self, slot: int, owner: int) -> tuple[torch.Tensor, ...]:
        """Owner's block in `slot` as `parts` tensors of its shape (views: writes land in the
        slot)."""
        shape = self.shapes[owner]
        n = math.prod(shape)
        flat = self.flat(slot, owner)
        return tuple(flat[i * n : (i + 1) * n].view(shape) for i in range(self.parts))

    def load(self, slot: int, owner: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy owner's block into `slot` and return its views."""
        views = self.views(slot, owner)
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t)
        return views
