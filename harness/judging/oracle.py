"""The oracle: single-device full attention with the explicit mask, forward and backward.

The float64 reference every rank is judged against, and the same plain attention in the case's own
dtype (the `base` whose error sets the tolerance). The computation is partitioned by the case: share g
is the rows rank g holds (`harness.ranks.reference`, which also computes it). Two ways to get the W shares:

- `ranks` (the default, `harness.runner`): each rank computes its own share on its own device after
  the implementation's run, and the pool sends the shares back;
- `local` (`--oracle local`, the tests' referee): this process computes the W shares one after another.

Either way `assemble` puts them together here: rows into the global out/lse/dq, dk/dv partials and
term-scale column sums added in rank order. Same shares, same order: on CPU the two ways give
bit-identical references (docs/tolerance.md states the bound for other devices).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from harness.case import Case
from harness.ranks import reference as shares_mod
from harness.ranks.reference import Share, TermScales

QUERY_BLOCK: int | None = None  # queries per block for `attention`; None: reference.query_block's score budget

__all__ = ["Reference", "TermScales", "Share", "attention", "assemble", "local", "references", "store", "cached"]


@dataclass
class Reference:
    """Global out, lse and q/k/v gradients, all in the compute dtype."""

    out: torch.Tensor  # (B, N, Hq, D)
    lse: torch.Tensor  # (B, Hq, N)
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    term_scale: dict[str, dict[str, float]] = field(default_factory=dict)  # tensor -> {rounding class: scale}


def _block_for(q: torch.Tensor, n: int) -> int:
    if QUERY_BLOCK is not None:
        return QUERY_BLOCK
    per_query = max(1, q.shape[0] * q.shape[2] * n)
    return max(shares_mod.MIN_QUERY_BLOCK, min(shares_mod.MAX_QUERY_BLOCK, shares_mod.SCORE_BUDGET // per_query))


def attention(q, k, v, dout, mask, scale: float, compute: torch.dtype) -> Reference:
    """Forward + backward of full attention of global tensors computed in `compute` (inputs are cast to
    it), every query in one share."""
    n = q.shape[1]
    rows = torch.arange(n, dtype=torch.long, device=q.device)
    exact = compute == torch.float64
    s = shares_mod.attend(q, k, v, dout, rows, mask, scale, compute, _block_for(q, n), terms=exact)
    return Reference(s.out, s.lse, s.dq, s.dk.to(s.out.dtype), s.dv.to(s.out.dtype),
                     s.terms.scales(scale) if s.terms is not None else {})


def assemble(case: Case, parts: Sequence[Share]) -> Reference:
    """The global reference from the W shares of one compute dtype, in rank order: each share's rows
    into out/lse/dq; dk, dv and the term-scale column sums added share by share, starting from zero."""
    if len(parts) != case.world_size:
        raise ValueError(f"{len(parts)} oracle shares for a {case.world_size}-rank case")
    first = parts[0]
    b, _, hq, d = first.out.shape
    n = case.total_len
    out = first.out.new_zeros(b, n, hq, d)
    dq = first.dq.new_zeros(b, n, hq, d)
    lse = first.lse.new_zeros(b, hq, n)
    dk, dv = torch.zeros_like(first.dk), torch.zeros_like(first.dv)
    terms = None
    for p in parts:
        out.index_copy_(1, p.rows, p.out)
        dq.index_copy_(1, p.rows, p.dq)
        lse.index_copy_(2, p.rows, p.lse)
        dk += p.dk
        dv += p.dv
        if p.terms is not None:
            if terms is None:
                terms = TermScales(torch.zeros(b, n, dk.shape[2], 0, dtype=torch.float64))
            terms.merge(p.terms)
    if dk.dtype != out.dtype:  # a reduced-precision base: partials summed in float32, rounded once
        dk, dv = dk.to(out.dtype), dv.to(out.dtype)
    return Reference(out, lse, dq, dk, dv, terms.scales(case.scale) if terms is not None else {})


def local(case: Case) -> tuple[Reference, Reference]:
    """(float64 reference, same-dtype base) computed here, share after share (what the ranks compute)."""
    pairs = [shares_mod.share(case, g) for g in range(case.world_size)]
    return assemble(case, [p[0] for p in pairs]), assemble(case, [p[1] for p in pairs])


_CACHE: dict[str, tuple[Reference, Reference]] = {}
_CACHE_MAX = 8


def _key(case: Case) -> str:
    return case.replace(impl="-", faults=(), tolerance={}, deadline_s=1.0).key()


def cached(case: Case) -> bool:
    """Whether the case's references are already known (no need to compute them again)."""
    return _key(case) in _CACHE


def store(case: Case, refs: tuple[Reference, Reference]) -> None:
    """Remember a case's (reference, base), e.g. assembled from the ranks' shares."""
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[_key(case)] = refs


def references(case: Case) -> tuple[Reference, Reference]:
    """(float64 reference, same-dtype base) for a case: the ranks' assembled shares when `store`d,
    else computed here (`local`); cached because shrinking and replays re-run the same inputs under
    other implementations or faults."""
    key = _key(case)
    if key not in _CACHE:
        store(case, local(case))
    return _CACHE[key]
