"""The geometry of a case: which rank holds each token, rank and chunk edges, document edges,
which blocks the mask lets a token see, and at which ring step each (token, block) cell is computed.
"""

from __future__ import annotations

import torch

from harness.case import Case
from ring_impl.layouts import all_positions, zigzag_chunks
from ring_impl.mask_eval import full_mask
from ring_impl.masks import doc_starts_of

# indexed by query token; dk/dv by key token
QUERY_TENSORS = ("out", "lse", "dq")


def owners(case: Case) -> torch.Tensor:
    """(N,) group rank that holds each global token."""
    own = torch.empty(case.total_len, dtype=torch.long)
    for r, pos in enumerate(all_positions(case.layout, case.seq_lens)):
        own[pos] = r
    return own


def row_order(case: Case) -> torch.Tensor:
    """Global tokens grouped by rank in local order: the heatmaps' row order."""
    return torch.cat(all_positions(case.layout, case.seq_lens))


def shard_edges(case: Case) -> torch.Tensor:
    """(N,) bool: the first or last token of a run of tokens that one rank holds.

    These are the rank and zigzag chunk edges.
    """
    n = case.total_len
    own = owners(case)
    # cut[p]: an edge lies between p - 1 and p
    cut = torch.zeros(n + 1, dtype=torch.bool)
    cut[0] = cut[n] = True
    cut[1:n] = own[1:] != own[:-1]
    if case.layout == "zigzag":
        start = 0
        for _, size in zigzag_chunks(case.seq_lens):
            start += size
            cut[min(start, n)] = True
    return cut[:-1] | cut[1:]


def doc_edges(case: Case) -> torch.Tensor:
    """(N,) bool: the first or last token of a document.

    Documents come from document masks, or from expressions with a document primitive or a
    per-document combinator. It takes two or more documents.
    """
    n = case.total_len
    edge = torch.zeros(n, dtype=torch.bool)
    for starts in doc_starts_of(case.mask.expression()):
        for s in starts[1:]:
            if s < n:
                edge[s] = True
                edge[s - 1] = True
    return edge


def block_visibility(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(query x key block, key x query block) bool.

    Whether the mask lets the token see the block, or be seen by it.
    """
    n = case.total_len
    m = full_mask(case.mask, n)
    if m is None:
        m = torch.ones(n, n, dtype=torch.bool)
    pos = all_positions(case.layout, case.seq_lens)
    by_key = torch.stack([m[:, p].any(dim=1) for p in pos], dim=1)
    by_query = torch.stack([m[p, :].any(dim=0) for p in pos], dim=1)
    return by_key, by_query


def step_of(case: Case, tensor: str) -> torch.Tensor:
    """(N, W): the ring step at which each (token, block) cell is computed.

    At step s, rank r holds the keys of rank (r - s) mod W. A query on rank r meets key block b at
    step (r - b) mod W. A key of rank o meets query block a at step (a - o) mod W.
    """
    own = owners(case).view(-1, 1)
    blk = torch.arange(case.world_size).view(1, -1)
    w = case.world_size
    return (own - blk) % w if tensor in QUERY_TENSORS else (blk - own) % w


def by_step(case: Case, tensor: str, grid: torch.Tensor) -> torch.Tensor:
    """Re-index an (N, W) token x block grid as token x ring step."""
    out = torch.full_like(grid, float("nan"))
    steps = step_of(case, tensor)
    out.scatter_(1, steps, grid)
    return out


def chunk_ids(case: Case) -> torch.Tensor:
    """(N,) the zigzag chunk (0 to 2W - 1, in sequence order) of each global token."""
    sizes = [size for _, size in zigzag_chunks(case.seq_lens)]
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
