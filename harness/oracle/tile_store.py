"""A one-pass oracle's tiles, handed from the rows pass to the keys pass.

In one pass (`assemble.whole`, `attention_pair`) the one share is the whole case. So the keys pass
forms the very tiles the rows pass's gradient sweep formed: the same P and dS, float64 and base,
from the same operands and statistics. The store hands them over instead of forming them again,
while they fit in BUDGET_BYTES. A tile not kept is formed again, as before. docs/oracle.md, "One
pass", has the evidence that the outputs keep their bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# a one-pass case of SMALL_ORACLE's size keeps ~32 bytes a score entry: a few MiB to ~128 MiB
BUDGET_BYTES = 256 << 20

# one tile's (base P, base s dS, float64 P, |dS|, s dS), as the gradient sweep formed them
Kept = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _key(pos: tuple[torch.Tensor, torch.Tensor]) -> tuple[bytes, bytes]:
    """A tile's identity: its query and key positions."""
    return tuple(p.cpu().numpy().tobytes() for p in pos)


@dataclass
class TileStore:
    """Tiles kept by their global positions, up to `budget` bytes."""

    budget: int = field(default_factory=lambda: BUDGET_BYTES)
    used: int = 0
    tiles: dict = field(default_factory=dict)

    def put(self, pos: tuple[torch.Tensor, torch.Tensor], kept: Kept) -> None:
        size = sum(t.numel() * t.element_size() for t in kept)
        if self.used + size <= self.budget:
            self.tiles[_key(pos)] = kept
            self.used += size

    def take(self, pos: tuple[torch.Tensor, torch.Tensor]) -> Kept | None:
        """A kept tile, given once (None: not kept)."""
        return self.tiles.pop(_key(pos), None) if self.tiles else None
