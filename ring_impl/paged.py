"""A paged KV cache, as serving engines hold it: a page pool and a block table per request.

A rank's KV share is cut into pages of P tokens, request by request. The pool holds every page:
(pages, P, heads, dim). The block table of request r on batch element b lists its pages in order:
local token c of the request sits in page `block_tables[b, r, c // P]` at offset `c % P`. Rows are
padded with page 0, the null page, which holds no token (vLLM reserves it the same way). Pages are
not in position order, and slots no token fills hold stale values, as a reused cache does.

`slots` and `read_pages` are the exact reading that the references use; the harness writes the
pool (`harness.paged`). Pure tensor indexing, no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NULL_PAGE = 0


@dataclass(frozen=True)
class PagedKV:
    """How this rank's KV share lies in its page pools.

    `block_tables`: int64 (batch, requests, most pages), padded with the null page. `lengths`:
    this rank's tokens of each request (`ServingInfo.kv_lengths[rank]`)."""

    page_size: int
    block_tables: torch.Tensor
    lengths: tuple[int, ...]


def slots(paged: PagedKV, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """(batch, tokens) flat pool slots of the local tokens in local order: page id * P + offset.

    `lengths` replaces the tokens read of each request (a paged mutant reads too many). A token
    past a request's table reads the null page, as a kernel reads a padded block table."""
    tables, p = paged.block_tables, paged.page_size
    per = []
    for r, n in enumerate(paged.lengths if lengths is None else lengths):
        c = torch.arange(n, device=tables.device)
        col = c // p
        page = tables[:, r, col.clamp(max=tables.shape[2] - 1)]
        page = torch.where(col < tables.shape[2], page, torch.full_like(page, NULL_PAGE))
        per.append(page * p + c % p)
    if not per:
        return torch.zeros((tables.shape[0], 0), dtype=torch.long, device=tables.device)
    return torch.cat(per, dim=1)


def read_pages(pool: torch.Tensor, paged: PagedKV) -> torch.Tensor:
    """(batch, tokens, heads, dim): the local KV share read from `pool` (pages, P, heads, dim).

    Differentiable: a backward through it lands in the pool's gradient."""
    return pool.flatten(0, 1)[slots(paged).to(pool.device)]


def read_kv(k: torch.Tensor, v: torch.Tensor, paged: PagedKV | None):
    """k and v as contiguous shares: read from their pools when `paged`, else as given."""
    if paged is None:
        return k, v
    return read_pages(k, paged), read_pages(v, paged)
