"""How the oracle cuts a case into tiles of queries x keys.

A tile holds at most SCORE_BUDGET score entries. Its side is a function of the case only, so every
way of computing the oracle uses the same tiles. A share's positions are cut into blocks (`runs`),
the keys into canonical groups (`Group`), and each block pair is trimmed to what its mask lets
meet (`visible_tiles`). docs/oracle.md explains the scheme.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from harness.case import Case
from harness.serving_case import kv_positions, oracle_rows
from ring_impl.mask_eval import allowed
from ring_impl.masks import MaskSpec

# score entries (batch x query heads x queries x keys) of one tile: 16 MiB float64
SCORE_BUDGET = 1 << 21
MAX_BLOCK = 1024
MIN_BLOCK = 16


def _libc_trim() -> Callable[[int], int]:
    """glibc's malloc_trim, or a no-op elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda pad: 0


TRIM = _libc_trim()


def _no_trim(pad: int) -> int:
    return 0


def trimmer(entries: int) -> Callable[[int], int]:
    """glibc's malloc_trim for work of more than one tile's score entries, else a no-op.

    A long share's tiles change size at the edges and glibc keeps the holes. A trim walks the whole
    heap, which costs more than a small case's whole oracle (docs/oracle.md, "Memory")."""
    if entries > SCORE_BUDGET:
        return TRIM
    return _no_trim


def block_size(batch: int, heads_q: int) -> int:
    """Queries (and keys) per tile side: the square tile of at most SCORE_BUDGET score entries,
    between MIN_BLOCK and MAX_BLOCK. A few float64 temporaries of that size live at once."""
    return max(MIN_BLOCK, min(MAX_BLOCK, math.isqrt(SCORE_BUDGET // max(1, batch * heads_q))))


def block(case: Case) -> int:
    """The case's tile side. It depends on the case only, so every way of computing the oracle
    uses the same tiles."""
    return block_size(case.batch, case.heads_q)


def runs(pos: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """Index ranges of at most `size` tiling a share's positions.

    Each contiguous run of positions is tiled on its own when the runs average MIN_BLOCK or more
    (zigzag's two chunks, a contiguous shard), so a mask's span over a tile stays tight. Otherwise
    (striped) the positions are cut into plain blocks."""
    n = pos.numel()
    breaks = ((pos[1:] != pos[:-1] + 1).nonzero().view(-1) + 1).tolist() if n > 1 else []
    if n == 0:
        return []
    if n < MIN_BLOCK * (len(breaks) + 1):
        return _even(0, n, size)
    edges = [0, *breaks, n]
    return [t for a, b in zip(edges[:-1], edges[1:], strict=True) for t in _even(a, b, size)]


def _even(a: int, b: int, size: int) -> list[tuple[int, int]]:
    """a:b cut into the fewest blocks of at most `size`, of equal length within one.

    1024 at 724 gives 512 + 512, not 724 + 300: a ragged last block's matmuls are slow for their
    size."""
    count = -(-(b - a) // size)
    step, extra = divmod(b - a, count)
    edges = [a + i * step + min(i, extra) for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


# (qa, qz, ka, kz, mask or None): queries qa:qz x keys ka:kz of a block pair, trimmed to what is
# seen
Tile = tuple


def visible_tiles(
    mask: MaskSpec, qpos: torch.Tensor, qblocks, kpos: torch.Tensor, kblocks, device
) -> list[Tile]:
    """Every (query block, key block) pair in which some query sees some key.

    Each is trimmed to the rows that see some key of the block and the keys some row sees. Causal,
    window and document masks leave much of a block pair out. The tile's mask is None when every
    query of the tile sees every key."""
    out = []
    for qa, qz in qblocks:
        for ka, kz in kblocks:
            m = allowed(mask, qpos[qa:qz], kpos[ka:kz])
            if m is None:
                out.append((qa, qz, ka, kz, None))
                continue
            rows, cols = m.any(dim=1).nonzero().view(-1), m.any(dim=0).nonzero().view(-1)
            if rows.numel() == 0:
                continue
            r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
            m = m[r0:r1, c0:c1]
            m = None if bool(m.all()) else m.to(device)
            out.append((qa + r0, qa + r1, ka + c0, ka + c1, m))
    return out


@dataclass(frozen=True)
class Group:
    """A canonical key group: consecutive blocks of the shares' positions, at most one tile side.

    The blocks are each share's `runs` blocks, shares in order; a block as long as a tile side is a
    group alone. The rows pass tiles its queries against each group whole. The keys pass of share h
    computes the same tile, whole, and keeps its own columns, `own[h]`. So both passes form each of
    the base's products with the same operands."""

    pos: torch.Tensor  # the group's global positions
    own: dict  # share -> (first column, end column, first index into the share's positions)


def groups(shares: Sequence[torch.Tensor], size: int) -> list[Group]:
    """The canonical key groups of shares with these positions (every share's, in order) and tile
    side."""
    out, cur = [], []

    def flush() -> None:
        own, width = {}, 0
        for h, a, z in cur:
            c0, _, o0 = own.get(h, (width, 0, a))
            own[h] = (c0, width + z - a, o0)
            width += z - a
        out.append(Group(torch.cat([shares[h][a:z] for h, a, z in cur]), own))
        cur.clear()

    for h, pos in enumerate(shares):
        for a, z in runs(pos, size):
            if cur and sum(y - x for _, x, y in cur) + z - a > size:
                flush()
            cur.append((h, a, z))
    if cur:
        flush()
    return out


# -- a case's tiles --------------------------------------------------------------------------


# the last case's geometry, by identity: `local` asks for it 2W times (a Case is frozen, and the
# reference held here keeps its id from being reused)
_LAST: dict = {"case": None, "made": {}}


def _of_case(case: Case, what: str, make):
    if _LAST["case"] is not case:
        _LAST.update(case=case, made={})
    made = _LAST["made"]
    if what not in made:
        made[what] = make()
    return made[what]


def positions(case: Case, index: int) -> torch.Tensor:
    """The query rows of share `index` (group rank): a training case's rows are the tokens the rank
    holds; a serving case's are its new tokens, each query in one share (`oracle_rows`)."""
    return oracle_rows(case)[index]


def key_positions(case: Case, index: int) -> torch.Tensor:
    """The keys of share `index`: the tokens whose K and V rank `index` holds."""
    return kv_positions(case)[index]


def blocks(case: Case) -> list[torch.Tensor]:
    """Every share's blocks of query rows (`runs`, shares in order): the query blocks of both
    passes."""
    size = block(case)
    return _of_case(
        case, "blocks", lambda: [p[a:z] for p in oracle_rows(case) for a, z in runs(p, size)]
    )


def key_groups(case: Case) -> list[Group]:
    """The case's canonical key groups (`Group`) over every share's keys."""
    return _of_case(case, "groups", lambda: groups(kv_positions(case), block(case)))
