"""The case's `serving` field: inference shapes, where queries are not the keys (issue #54).

A serving case holds a batch of requests packed along the tokens (`ring_impl.serving.Requests`).
Each request has cached tokens and new ones; the new ones are the queries. The KV of every token is
spread over the ranks by `kv`. This module reads and writes the field, derives the per-rank
lengths, and gives every consumer the same positions and mask:

- `kv_positions(case)`: each rank's key/value tokens (a training case: its layout's positions);
- `query_positions(case)`: each rank's query rows (a training case: the same tokens);
- `oracle_rows(case)`: the rows each oracle share computes, every query once;
- `mask_of(case)`: the case's mask within each request (a training case: its mask).

docs/case-model.md has the model.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from harness import limits
from harness.errors import HarnessError
from ring_impl import serving
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec
from ring_impl.serving import KV_LAYOUTS, QUERY_FORMS, Requests

if TYPE_CHECKING:
    from harness.case import Case

KEYS = ("context", "new", "kv", "interleave", "queries", "page_size")
MAX_PAGE = 1024
MAX_REQUESTS = 256
SHAPES = ("train", "prefill", "decode")


def _field(msg: str) -> HarnessError:
    return HarnessError(f"case field 'serving': {msg}")


def _lengths(d: dict, name: str, lo: int) -> tuple[int, ...]:
    got = d.get(name)
    if not isinstance(got, list) or not got or len(got) > MAX_REQUESTS:
        raise _field(f"{name} must be a list of 1 to {MAX_REQUESTS} integers, got {got!r}")
    each = limits.Range(lo, 2**30)
    for x in got:
        if not each.holds(x):
            raise _field(f"every entry of {name} must be {each.words()}, got {got!r}")
    return tuple(got)


def from_dict(d: Any) -> Requests:
    """A validated `Requests` from a case file's `serving:` mapping."""
    if not isinstance(d, dict):
        raise _field(f"must be a mapping like {{context: [64], new: [1]}}, got {d!r}")
    unknown = set(d) - set(KEYS)
    if unknown:
        raise _field(
            f"unknown key(s) {', '.join(sorted(map(str, unknown)))}; expected {', '.join(KEYS)}"
        )
    context, new = _lengths(d, "context", 0), _lengths(d, "new", 1)
    kv, queries = d.get("kv", "contiguous"), d.get("queries", "own")
    if kv not in KV_LAYOUTS:
        raise _field(f"kv must be one of {', '.join(KV_LAYOUTS)}, got {kv!r}")
    if queries not in QUERY_FORMS:
        raise _field(f"queries must be one of {', '.join(QUERY_FORMS)}, got {queries!r}")
    interleave = d.get("interleave", 1)
    if not limits.Range(1, 2**20).holds(interleave):
        raise _field(f"interleave must be an integer in [1, 2**20], got {interleave!r}")
    page_size = d.get("page_size", 0)
    if not limits.Range(0, MAX_PAGE).holds(page_size):
        raise _field(f"page_size must be an integer in [0, {MAX_PAGE}], got {page_size!r}")
    try:
        return Requests(context, new, kv, interleave, queries, page_size)
    except ValueError as e:
        raise _field(str(e)) from None


def to_dict(req: Requests) -> dict:
    """The plain-data form; `interleave`, `queries` and `page_size` only when they matter."""
    d: dict = {"context": list(req.context), "new": list(req.new), "kv": req.kv}
    if req.kv == "interleaved":
        d["interleave"] = req.interleave
    if req.queries != "own":
        d["queries"] = req.queries
    if req.page_size:
        d["page_size"] = req.page_size
    return d


def shape_of(req: Requests | None) -> str:
    """The inference shape: decode (one new token per request), prefill (more), or train."""
    if req is None:
        return "train"
    return "decode" if max(req.new) == 1 else "prefill"


def describe(req: Requests) -> str:
    """A short form: 'ctx700,33,0 new1,1,4 kv=interleaved/16 q=replicated paged/16'."""
    kv = f"{req.kv}/{req.interleave}" if req.kv == "interleaved" else req.kv
    q = " q=replicated" if req.queries == "replicated" else ""
    paged = f" paged/{req.page_size}" if req.page_size else ""
    ctx = ",".join(map(str, req.context))
    new = ",".join(map(str, req.new))
    return f"ctx{ctx} new{new} kv={kv}{q}{paged}"


def seq_lens(req: Requests, world_size: int) -> tuple[int, ...]:
    """Each rank's KV length: what a serving case's `seq_lens` must be."""
    return tuple(sum(n) for n in serving.local_lengths(req, world_size))


@lru_cache(maxsize=64)
def _kv(req: Requests, world_size: int) -> tuple[torch.Tensor, ...]:
    return tuple(serving.kv_positions(req, world_size))


@lru_cache(maxsize=64)
def _queries(req: Requests, world_size: int) -> tuple[torch.Tensor, ...]:
    return tuple(serving.query_positions(req, world_size))


@lru_cache(maxsize=64)
def _own(req: Requests, world_size: int) -> tuple[torch.Tensor, ...]:
    every = req.query_positions()
    return tuple(p[torch.isin(p, every)] for p in _kv(req, world_size))


def kv_positions(case: Case) -> tuple[torch.Tensor, ...]:
    """Every rank's key/value positions, in local order. Do not modify them: they are shared."""
    if case.serving is None:
        return _training(case.layout, case.seq_lens)
    return _kv(case.serving, case.world_size)


def query_positions(case: Case) -> tuple[torch.Tensor, ...]:
    """Every rank's query rows: its own tokens (training), or its requests' new tokens."""
    if case.serving is None:
        return _training(case.layout, case.seq_lens)
    return _queries(case.serving, case.world_size)


def oracle_rows(case: Case) -> tuple[torch.Tensor, ...]:
    """The rows oracle share g computes: every query exactly once, with the KV it sits beside.

    Replicated queries are judged on every rank against these rows."""
    if case.serving is None:
        return _training(case.layout, case.seq_lens)
    return _own(case.serving, case.world_size)


@lru_cache(maxsize=64)
def _training(layout: str, lens: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(all_positions(layout, lens))


def mask_of(case: Case) -> MaskSpec:
    """The mask over global positions: the case's mask within each request.

    A new token at position p of a request sees that request's keys the mask allows: causal is
    bottom-right causal over the cached context."""
    if case.serving is None:
        return case.mask
    return _within(case.mask, serving.document_starts(case.serving))


_within = lru_cache(maxsize=64)(serving.mask_within)


def check(c: Case) -> None:
    """A serving case's other fields agree with its requests (HarnessError naming the field)."""
    req = c.serving
    if not isinstance(req, Requests):
        raise _field(f"must be a serving mapping, got {req!r}")
    if c.inputs == "fused-qkv":
        raise HarnessError(
            "case field 'inputs': fused-qkv needs as many queries as keys; a serving case has fewer"
        )
    if c.layout != "contiguous":
        raise HarnessError(
            "case field 'layout': a serving case spreads its KV by serving.kv; leave layout out"
        )
    if req.page_size and c.inputs != "contiguous":
        raise HarnessError(
            f"case field 'inputs': a paged KV cache (serving.page_size) comes with contiguous "
            f"queries, got inputs {c.inputs!r}"
        )
    try:
        want = seq_lens(req, c.world_size)
    except ValueError as e:  # e.g. zigzag of a request too short for two chunks a rank
        raise _field(str(e)) from None
    if tuple(c.seq_lens) != want:
        raise HarnessError(
            f"case field 'seq_lens': a serving case's are its ranks' KV lengths {list(want)}, "
            f"got {list(c.seq_lens)}; leave seq_lens out"
        )
