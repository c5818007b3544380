"""Sequence layouts as position maps: which global token positions each rank holds.

One place for sharding and unsharding, shared by the reference ring, adapters and the harness.
A layout is fully described by its name and the per-rank local lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS = ("contiguous", "zigzag", "striped")


def split_lengths(total: int, world_size: int) -> list[int]:
    """Even split of `total` tokens over `world_size` ranks; the first `total % W` get one more."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if total < 0:
        raise ValueError(f"total length must be >= 0, got {total}")
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def _check(layout: str, lengths: Sequence[int]) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if len(lengths) == 0:
        raise ValueError("lengths must name at least one rank")
    if any(int(n) < 0 for n in lengths):
        raise ValueError(f"per-rank lengths must be >= 0, got {list(lengths)}")


def zigzag_chunks(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(rank, size) of the 2W zigzag chunks in sequence order: chunk r and 2W-1-r live on rank r.

    Rank r's local length splits into a first chunk of ceil(L/2) and a second of floor(L/2).
    """
    first = [(r, (int(n) + 1) // 2) for r, n in enumerate(lengths)]
    second = [(r, int(n) // 2) for r, n in enumerate(lengths)]
    return first + second[::-1]


def all_positions(layout: str, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Global positions (int64, local order) of the tokens of every rank."""
    _check(layout, lengths)
    w = len(lengths)
    total = sum(int(n) for n in lengths)
    if layout == "contiguous":
        out, start = [], 0
        for n in lengths:
            out.append(torch.arange(start, start + int(n), dtype=torch.long))
            start += int(n)
        return out
    if layout == "zigzag":
        parts: list[list[torch.Tensor]] = [[] for _ in range(w)]
        start = 0
        for r, size in zigzag_chunks(lengths):
            parts[r].append(torch.arange(start, start + size, dtype=torch.long))
            start += size
        return [torch.cat(p) for p in parts]
    # striped: deal tokens round-robin, skipping ranks that already hold their share; with the
    # default split this is exactly "token i on rank i mod W".
    remaining = [int(n) for n in lengths]
    owner: list[list[int]] = [[] for _ in range(w)]
    r = 0
    for pos in range(total):
        while remaining[r] == 0:
            r = (r + 1) % w
        owner[r].append(pos)
        remaining[r] -= 1
        r = (r + 1) % w
    return [torch.tensor(o, dtype=torch.long) for o in owner]


def positions(layout: str, lengths: Sequence[int], rank: int) -> torch.Tensor:
    """Global positions (int64, local order) of the tokens held by `rank`."""
    if not 0 <= rank < len(lengths):
        raise ValueError(f"rank {rank} out of range for {len(lengths)} ranks")
    return all_positions(layout, lengths)[rank]


def shard(
    x: torch.Tensor, layout: str, lengths: Sequence[int], rank: int, dim: int = 1
) -> torch.Tensor:
    """The slice of a global tensor (sequence along `dim`) that `rank` holds, contiguous."""
    total = sum(int(n) for n in lengths)
    if x.shape[dim] != total:
        raise ValueError(f"tensor has {x.shape[dim]} tokens along dim {dim}, layout covers {total}")
    return x.index_select(dim, positions(layout, lengths, rank).to(x.device)).contiguous()


def unshard(
    shards: Sequence[torch.Tensor], layout: str, lengths: Sequence[int], dim: int = 1
) -> torch.Tensor:
    """Reassemble a global tensor from every rank's shard (inverse of `shard`)."""
    if len(shards) != len(lengths):
        raise ValueError(f"got {len(shards)} shards for {len(lengths)} ranks")
    pos = all_positions(layout, lengths)
    for r, (s, p) in enumerate(zip(shards, pos, strict=True)):
        if s.shape[dim] != p.numel():
            raise ValueError(
                f"rank {r} shard has {s.shape[dim]} tokens, layout expects {p.numel()}"
            )
    cat = torch.cat(list(shards), dim=dim)
    inverse = torch.empty(cat.shape[dim], dtype=torch.long)
    inverse[torch.cat(pos)] = torch.arange(cat.shape[dim])
    return cat.index_select(dim, inverse.to(cat.device))
