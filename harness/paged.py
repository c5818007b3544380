"""The paged KV input form: a serving case's KV share handed over as page pools (issue #54).

A case whose `serving.page_size` is P >= 1 gives the ring k and v as pools of P-token pages, and
`RunContext.pages` (a `ring_impl.paged.PagedKV`) with each request's block table. The pages are
placed in an order drawn from the case seed and the rank, never in position order; a quarter more
pages than needed stay free; page 0 is the null page. Every slot no token fills holds stale values
from the same seed, so a ring that reads a page or a slot it does not own reads wrong numbers.

The gradients of the pools are read back at the slots of the tokens, so dk and dv are judged as
for contiguous shares. This module runs on the ranks; it imports torch only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from harness.calls import Presented
from harness.context import RunContext
from ring_impl.paged import NULL_PAGE, PagedKV, slots

SPARE = 4  # one free page for every four in use


def _seed(seed: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed & (2**63 - 1), 7919, rank]).generate_state(1)[0])


def block_tables(
    lengths: tuple[int, ...], batch: int, page_size: int, gen
) -> tuple[torch.Tensor, int]:
    """((batch, requests, most pages) page ids drawn without repeats, padded with the null
    page; the pool's page count)."""
    need = [-(-n // page_size) for n in lengths]
    used = batch * sum(need)
    pool = 1 + used + max(1, used // SPARE)
    ids = (torch.randperm(pool - 1, generator=gen)[:used] + 1).tolist()
    tables = torch.full((batch, len(lengths), max(need, default=0) or 1), NULL_PAGE)
    for b in range(batch):
        for r, n in enumerate(need):
            for i in range(n):
                tables[b, r, i] = ids.pop()
    return tables, pool


def _pool(x: torch.Tensor, where: torch.Tensor, pages: int, page_size: int, gen) -> torch.Tensor:
    """A (pages, P, heads, dim) pool with x's tokens at `where` and stale values elsewhere."""
    stale = torch.randn((pages * page_size, *x.shape[2:]), generator=gen).to(x.dtype)
    stale[where.flatten().cpu()] = x.detach().flatten(0, 1).cpu()
    return stale.to(x.device).view(pages, page_size, *x.shape[2:])


def present(x: Presented, ctx: RunContext, grad: bool) -> tuple[Presented, RunContext]:
    """`x` with k and v as page pools, and `ctx` with their block tables (`ctx.pages`)."""
    req = ctx.serving
    lengths = tuple(req.kv_lengths[ctx.rank])
    gen = torch.Generator().manual_seed(_seed(ctx.seed, ctx.rank))
    tables, pages = block_tables(lengths, x.k.shape[0], req.page_size, gen)
    paged = PagedKV(req.page_size, tables.to(x.k.device), lengths)
    where = slots(PagedKV(req.page_size, tables, lengths))
    k, v = (_pool(t, where, pages, req.page_size, gen).requires_grad_(grad) for t in (x.k, x.v))
    q = x.leaves[0]
    moved = dataclasses.replace(x, k=k, v=v, leaves=(q, k, v), slots=where.to(x.k.device))
    return moved, dataclasses.replace(ctx, pages=paged)
