"""Tiles of the oracle kept for a later sweep, instead of formed again.

A rows pass forms each tile's scores in three sweeps and its base's dP in two. Each is kept from
its first sweep for the next. In one pass (`assemble.whole`, `attention_pair`) the one share is
the whole case, so the keys pass forms the very P and dS the gradient sweep formed: those are
handed over too. The same ops run on the same operands once instead of again, so the outputs keep
their bits. A store keeps tiles while they fit in BUDGET_BYTES; a tile not kept is formed again.
docs/oracle.md, "Kept tiles", has the evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# a small case keeps every tile (~48 bytes a score entry); a long one, its first tiles
BUDGET_BYTES = 256 << 20
# what a rows pass keeps a score entry at most: both scores, softcap's tanh and factor, base dP
ROWS_BYTES = 32

# kinds: "base" (the base's scores and tanh), "exact" (float64 scores and softcap's factor),
# "dp" (the base's dP), "grad" (base P, base s dS, float64 P, |dS|, s dS: for the keys pass)


def _key(kind: str, pos: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """A tile's identity: the kind, and its query and key positions."""
    return (kind, *(p.cpu().numpy().tobytes() for p in pos))


def _nbytes(tensors: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class TileStore:
    """Tiles kept by kind and global positions, up to `budget` bytes."""

    handover: bool = True  # keep "grad" tiles: a keys pass of the same share follows
    budget: int = field(default_factory=lambda: BUDGET_BYTES)
    used: int = 0
    tiles: dict = field(default_factory=dict)

    def put(self, kind: str, pos, tensors: tuple, copy: bool = False) -> None:
        """Keep a tile's tensors if they fit; copies of them with `copy` (the caller consumes
        its own)."""
        size = _nbytes(tensors)
        if self.used + size > self.budget or (kind == "grad" and not self.handover):
            return
        if copy:
            tensors = tuple(None if t is None else t.clone() for t in tensors)
        self.tiles[_key(kind, pos)] = tensors
        self.used += size

    def take(self, kind: str, pos, again: bool = False) -> tuple | None:
        """A kept tile's tensors, the caller's to consume (None: not kept). With `again`, the tile
        stays for a later sweep and the caller gets copies."""
        if not self.tiles:
            return None
        key = _key(kind, pos)
        if not again:
            got = self.tiles.pop(key, None)
            if got is not None:
                self.used -= _nbytes(got)
            return got
        got = self.tiles.get(key)
        return None if got is None else tuple(None if t is None else t.clone() for t in got)


def rows_store(entries: int) -> TileStore | None:
    """A store for a share's rows pass of `entries` score entries, if all of them fit. A long
    share keeps none: its memory stays that of its tiles (docs/long-sequences.md)."""
    return TileStore(handover=False) if entries * ROWS_BYTES <= BUDGET_BYTES else None
