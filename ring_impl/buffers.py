"""Double buffers for blocks travelling the ring: one slot is sent while the other is received into.

A slot is one flat tensor big enough for the largest owner's block; the view for owner j is
exactly as long as j's block, so uneven shards need no padding on the wire. A block is several
tensors (k and v), each of its own shape: v may have a head dim of its own (MLA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class DoubleBuffer:
    """Two flat slots, each holding one owner's block: the tensors of shapes `shapes[owner]`."""

    def __init__(
        self,
        shapes: Sequence[Sequence[tuple[int, ...]]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shapes = [tuple(tuple(s) for s in block) for block in shapes]
        # each owner's tensors' lengths, and their sum: asked at every ring step
        self.lengths = [[math.prod(s) for s in block] for block in self.shapes]
        self.sizes = [sum(n) for n in self.lengths]
        size = max(self.sizes, default=0)
        self.slots = [torch.empty(size, dtype=dtype, device=device) for _ in range(2)]

    def flat(self, slot: int, owner: int) -> torch.Tensor:
        """The contiguous 1-D view that carries owner's block in `slot` (what goes on the wire)."""
        return self.slots[slot][: self.sizes[owner]]

    def views(self, slot: int, owner: int) -> tuple[torch.Tensor, ...]:
        """Owner's block in `slot` as tensors of their shapes (views: writes land in the slot)."""
        flat, at, out = self.flat(slot, owner), 0, []
        for shape, n in zip(self.shapes[owner], self.lengths[owner], strict=True):
            out.append(flat[at : at + n].view(shape))
            at += n
        return tuple(out)

    def load(self, slot: int, owner: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy owner's block into `slot` and return its views."""
        views = self.views(slot, owner)
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t)
        return views
