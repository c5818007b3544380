"""Greedy shrinking of a fixed failing case, from the battery or the fault stage.

Such a case has no generator for hypothesis to shrink. So the shrinker tries simpler variants of the
case, most aggressive first, and keeps the first that still fails. It repeats until none does or the
budget is spent. It keeps the failure's signature and, with `fresh`, a failure that reproduces on
fresh ranks. docs/check.md has the order of "simpler" and the rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from harness.case import Case
from harness.case_schema import VALUE_KINDS
from harness.errors import HarnessError
from harness.result import CaseResult
from harness.search.signature import Signature
from harness.search.strategies import DTYPE_ORDER
from ring_impl.layouts import LAYOUTS, split_lengths
from ring_impl.masks import COMBINATORS, EXPR, SPEC_KINDS, Expr, MaskSpec, fit, prim


def _variant(c: Case, **changes: Any) -> Case | None:
    """`c` with `changes`, or None when that is not a valid case."""
    try:
        return c.replace(**changes)
    except (HarnessError, ValueError, TypeError):
        return None


def _fit_mask(mask: MaskSpec, total: int) -> MaskSpec:
    """The mask for a sequence cut to `total` tokens. Document starts beyond it are dropped."""
    return fit(mask, total)


def _with_lens(c: Case, lens: tuple[int, ...]) -> Case | None:
    return _variant(c, seq_lens=lens, mask=_fit_mask(c.mask, sum(lens)))


def _fewer_ranks(c: Case) -> Iterator[Case | None]:
    for w in range(1, c.world_size):
        faults = tuple(f for f in c.faults if f.get("rank") is None or f["rank"] < w)
        if c.total_len < w or len(faults) != len(c.faults) or (faults and w < 2):
            continue
        yield _variant(
            c, world_size=w, seq_lens=tuple(split_lengths(c.total_len, w)), faults=faults
        )
    for off in sorted({0, c.group_offset - 1}):
        if off < c.group_offset:
            yield _variant(c, group_offset=off)


def _fewer_tokens(c: Case) -> Iterator[Case | None]:
    w, total = c.world_size, c.total_len
    for t in sorted({w, total // 2, total - 1}):
        if w <= t < total:
            yield _with_lens(c, tuple(split_lengths(t, w)))
    even = tuple(split_lengths(total, w))
    if tuple(c.seq_lens) != even:
        yield _variant(c, seq_lens=even)
    for r, n in enumerate(c.seq_lens):
        for m in sorted({1, n // 2, n - 1}):
            if 1 <= m < n:
                yield _with_lens(c, tuple(m if i == r else x for i, x in enumerate(c.seq_lens)))


def _smaller_shape(c: Case) -> Iterator[Case | None]:
    if c.batch > 1:
        yield _variant(c, batch=1)
    pairs = sorted(
        (hq, hkv)
        for hkv in range(1, c.heads_kv + 1)
        for hq in range(hkv, c.heads_q + 1, hkv)
        if (hq, hkv) != (c.heads_q, c.heads_kv)
    )
    for hq, hkv in pairs[:8]:
        sinks = None if c.sinks is None else c.sinks[:hq]  # the first heads keep their sinks
        yield _variant(c, heads_q=hq, heads_kv=hkv, sinks=sinks)
    for d in sorted({1, 2, 4, 8, c.head_dim // 2, c.head_dim - 1}):
        if 1 <= d < c.head_dim:
            yield _variant(c, head_dim=d)
    for d in sorted({1, 2, 4, 8, c.dim_v // 2, c.dim_v - 1} - {c.head_dim}):
        if c.head_dim_v is not None and 1 <= d < c.dim_v:
            yield _variant(c, head_dim_v=d)


def _simpler_params(e: Expr) -> Iterator[Expr]:
    """The primitive with one parameter made smaller, then with fewer blocks or documents.

    A parameter is halved, or made one less.
    """
    for i, v in enumerate(e.params):
        if isinstance(v, int):
            for smaller in sorted({0, 1, v // 2, v - 1}):
                if 0 <= smaller < v:
                    try:
                        yield Expr(e.op, e.params[:i] + (smaller,) + e.params[i + 1 :])
                    except ValueError:
                        pass
        elif e.op == "document":
            for s in v[1:]:
                yield prim("document", tuple(x for x in v if x != s))
        elif e.op == "blocks":
            for p in v:
                yield prim("blocks", e.params[0], tuple(x for x in v if x != p))


def simpler_expressions(e: Expr) -> Iterator[Expr]:
    """Strictly simpler expressions, most aggressive first.

    They are an operand alone, an operand dropped, a simpler operand, then smaller parameters.
    """
    if e.op in COMBINATORS:
        yield from e.args
        if e.op in ("and", "or") and len(e.args) > 2:
            for i in range(len(e.args)):
                yield Expr(e.op, args=e.args[:i] + e.args[i + 1 :])
        if e.op == "per-document":
            for s in e.params[0][1:]:
                yield Expr(e.op, (tuple(x for x in e.params[0] if x != s),), e.args)
        for i, a in enumerate(e.args):
            for b in simpler_expressions(a):
                yield Expr(e.op, e.params, e.args[:i] + (b,) + e.args[i + 1 :])
        return
    yield from _simpler_params(e)


def _simpler_mask(c: Case) -> Iterator[Case | None]:
    m = c.mask
    if m.kind == EXPR:
        for kind in ("none", "causal"):
            yield _variant(c, mask=MaskSpec(kind))
        for e in simpler_expressions(m.expr):
            yield _variant(c, mask=MaskSpec.of(e))
        return
    for kind in SPEC_KINDS[: SPEC_KINDS.index(m.kind)]:
        if kind in ("none", "causal"):
            yield _variant(c, mask=MaskSpec(kind))
    if m.kind == "window":
        for win in sorted({0, 1, m.window // 2, m.window - 1}):
            if 0 <= win < m.window:
                yield _variant(c, mask=MaskSpec("window", window=win))
    if m.kind == "document":
        for s in m.doc_starts[1:]:
            yield _variant(
                c,
                mask=MaskSpec(
                    "document", doc_starts=tuple(x for x in m.doc_starts if x != s), causal=m.causal
                ),
            )
        if not m.causal:
            yield _variant(c, mask=MaskSpec("document", doc_starts=m.doc_starts, causal=True))


def _plainer(c: Case) -> Iterator[Case | None]:
    for layout in LAYOUTS[: LAYOUTS.index(c.layout)]:
        yield _variant(c, layout=layout)
    for dtype in DTYPE_ORDER[: DTYPE_ORDER.index(c.dtype)]:
        yield _variant(c, dtype=dtype)
    for values in VALUE_KINDS[: VALUE_KINDS.index(c.values)]:
        yield _variant(c, values=values)
    # The plain training call, then contiguous inputs (harness.calls).
    if c.call != "train":
        yield _variant(c, call="train")
    if c.inputs != "contiguous":
        yield _variant(c, inputs="contiguous")
    if c.softmax_scale is not None:
        yield _variant(c, softmax_scale=None)
    yield from _plainer_variants(c)


def _plainer_variants(c: Case) -> Iterator[Case | None]:
    """Towards plain attention: each variant off, then zero sinks (the usual initial value)."""
    for name, plain in (("sinks", None), ("softcap", None), ("alibi", False), ("head_dim_v", None)):
        if getattr(c, name) != plain:
            yield _variant(c, **{name: plain})
    if c.sinks is not None and any(c.sinks):
        yield _variant(c, sinks=(0.0,) * c.heads_q)


def candidates(c: Case) -> Iterator[Case]:
    """Valid, strictly simpler variants of `c`, in the order they are tried."""
    for gen in (_fewer_ranks, _fewer_tokens, _smaller_shape, _simpler_mask, _plainer):
        for v in gen(c):
            if v is not None and v != c:
                yield v


def case_size(c: Case) -> tuple:
    """An order on cases towards the shrink target: fewer ranks, tokens and heads,
    a simpler mask...
    """
    mask = (SPEC_KINDS.index(c.mask.kind), c.mask.expr.size() if c.mask.expr is not None else 0)
    return (
        c.world_size,
        c.total_len,
        c.batch,
        c.heads_q,
        c.heads_kv,
        c.head_dim,
        mask,
        LAYOUTS.index(c.layout),
        c.group_offset,
        len(c.variants),
        c.dim_v,
    )


def shrink(
    first: CaseResult,
    still_fails: Callable[[Case], CaseResult | None],
    *,
    budget_s: float = 60.0,
    max_tries: int = 200,
    others: dict[Signature, CaseResult] | None = None,
    signature: Callable[[CaseResult], Signature] = Signature.of,
    fresh: Callable[[CaseResult], bool] | None = None,
) -> tuple[CaseResult, int]:
    """Shrink `first`: (the smallest failing result with its signature, candidates tried).

    `still_fails(case)` returns the failing result of a candidate. It returns None when the
    candidate passes, or does not fail the way that counts. A candidate failing with another
    signature goes to `others`, signature -> smallest result. `fresh(result)` says whether a
    result's failure reproduces alone on fresh ranks (docs/check.md).
    """
    target = signature(first)
    chain, tried, start = [first], set(), time.monotonic()
    improved = True
    while improved:
        improved = False
        for cand in candidates(chain[-1].case):
            key = cand.key()
            if key in tried:
                continue
            if len(tried) >= max_tries or time.monotonic() - start > budget_s:
                return _confirmed(chain, fresh), len(tried)
            tried.add(key)
            r = still_fails(cand)
            if r is None:
                continue
            sig = signature(r)
            # A different failure: recorded, not shrunk into.
            if sig != target:
                if others is not None and (
                    sig not in others or case_size(r.case) < case_size(others[sig].case)
                ):
                    others[sig] = r
                continue
            chain.append(r)
            improved = True
            break
    return _confirmed(chain, fresh), len(tried)


def _confirmed(chain: list[CaseResult], fresh: Callable[[CaseResult], bool] | None) -> CaseResult:
    """The newest accepted result whose failure reproduces on fresh ranks.

    The first one is taken as given.
    """
    if fresh is None:
        return chain[-1]
    for r in reversed(chain[1:]):
        if fresh(r):
            return r
    return chain[0]
