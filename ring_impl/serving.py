"""Inference shapes as position maps: requests, their KV cache across ranks, and their new tokens.

A batch of requests is packed along the tokens, one request after another, as engines hold them.
Request r holds context[r] cached tokens then new[r] new ones; its new tokens are the queries. The
KV cache of each request is spread over the W ranks by `kv`:

- contiguous: the request's tokens cut into W contiguous shares (the first get one more);
- interleaved: token t on rank floor(t / I) mod W, vLLM's `cp_kv_cache_interleave_size` I: local
  slot c on rank r holds t = floor(c / I) W I + r I + c mod I;
- zigzag and striped: the training layouts, applied to each request alone.

With `page_size` P, each rank holds its share in pages of P tokens (`ring_impl.paged`).

A rank's KV is its tokens of request 0, then of request 1, ..., each in increasing position. Its
queries (`queries: own`) are the new tokens it holds the KV of; `replicated` gives every rank every
query. Pure data and integer maps: the reference rings, the oracle and the harness share them.
docs/case-model.md has the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ring_impl.layouts import all_positions, split_lengths
from ring_impl.masks import MaskSpec, and_, prim

KV_LAYOUTS = ("contiguous", "interleaved", "zigzag", "striped")
QUERY_FORMS = ("own", "replicated")


@dataclass(frozen=True)
class Requests:
    """A packed batch of requests: cached and new tokens per request, and how they are spread."""

    context: tuple[int, ...]
    new: tuple[int, ...]
    kv: str = "contiguous"
    interleave: int = 1
    queries: str = "own"
    page_size: int = 0  # 0: each rank's KV share contiguous; P >= 1: paged, P tokens a page

    def __post_init__(self) -> None:
        if not self.context or len(self.context) != len(self.new):
            raise ValueError(
                f"context and new must name the same requests, got {list(self.context)} and "
                f"{list(self.new)}"
            )
        if any(c < 0 for c in self.context) or any(n < 1 for n in self.new):
            raise ValueError("every request needs context >= 0 and at least one new token")
        if self.kv not in KV_LAYOUTS:
            raise ValueError(f"unknown kv layout {self.kv!r}; expected one of {KV_LAYOUTS}")
        if self.queries not in QUERY_FORMS:
            raise ValueError(f"unknown queries {self.queries!r}; expected one of {QUERY_FORMS}")
        if self.interleave < 1:
            raise ValueError(f"interleave must be >= 1, got {self.interleave}")
        if self.page_size < 0:
            raise ValueError(f"page_size must be >= 0, got {self.page_size}")

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each request's tokens: context and new."""
        return tuple(c + n for c, n in zip(self.context, self.new, strict=True))

    @property
    def starts(self) -> tuple[int, ...]:
        """Each request's first global position in the packed sequence."""
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def query_positions(self) -> torch.Tensor:
        """The global positions of every new token, in request order."""
        pieces = [
            torch.arange(s + c, s + c + n, dtype=torch.long)
            for s, c, n in zip(self.starts, self.context, self.new, strict=True)
        ]
        return torch.cat(pieces)


def request_owners(kv: str, length: int, world_size: int, interleave: int = 1) -> torch.Tensor:
    """The rank holding each token t = 0..length-1 of one request."""
    if kv == "interleaved":
        return torch.div(torch.arange(length), interleave, rounding_mode="floor") % world_size
    owner = torch.empty(length, dtype=torch.long)
    for r, pos in enumerate(all_positions(kv, split_lengths(length, world_size))):
        owner[pos] = r
    return owner


def kv_positions(req: Requests, world_size: int) -> list[torch.Tensor]:
    """Every rank's KV positions (global, local order): its tokens of each request in turn."""
    parts: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for start, n in zip(req.starts, req.lengths, strict=True):
        owner = request_owners(req.kv, n, world_size, req.interleave)
        for r in range(world_size):
            parts[r].append(start + (owner == r).nonzero().view(-1))
    return [torch.cat(p) if p else torch.zeros(0, dtype=torch.long) for p in parts]


def query_positions(req: Requests, world_size: int) -> list[torch.Tensor]:
    """Every rank's query positions: its own new tokens, or every new token when replicated."""
    every = req.query_positions()
    if req.queries == "replicated":
        return [every.clone() for _ in range(world_size)]
    return [p[torch.isin(p, every)] for p in kv_positions(req, world_size)]


def slot_position(slot: int, rank: int, world_size: int, interleave: int) -> int:
    """vLLM's slot mapping: the request-relative token that local slot `slot` of `rank` holds."""
    i = interleave
    return (slot // i) * world_size * i + rank * i + slot % i


def local_lengths(req: Requests, world_size: int) -> list[tuple[int, ...]]:
    """Per rank, its KV length of each request (what a paged cache's block table covers)."""
    out = []
    for r in range(world_size):
        out.append(
            tuple(
                int((request_owners(req.kv, n, world_size, req.interleave) == r).sum())
                for n in req.lengths
            )
        )
    return out


def document_starts(req: Requests) -> tuple[int, ...]:
    """The requests' starts as a document mask's: attention never crosses a request."""
    return tuple(s for s, n in zip(req.starts, req.lengths, strict=True) if n > 0)


def mask_within(mask: MaskSpec, starts: Sequence[int]) -> MaskSpec:
    """`mask` within each request (document starts `starts`): attention never crosses a request, and
    causal is bottom-right causal for the new tokens."""
    if len(starts) <= 1:
        return mask
    return MaskSpec.of(and_(prim("document", tuple(starts)), mask.expression()))


def check_positions(positions: Sequence[torch.Tensor], total: int) -> None:
    """Every position 0..total-1 held by exactly one rank (a KV distribution partitions them)."""
    seen = torch.cat(list(positions)).sort().values
    if not torch.equal(seen, torch.arange(total)):
        raise ValueError("the KV shares do not partition the sequence")
