"""What a mask allows: the one predicate over global positions, and the questions built on it.

A block's mask is `allowed(spec, q_positions, k_positions)`. The same predicate gives the oracle's
explicit mask and the reference ring's per-block decision (`block_decision`: skip, full or partial).
It also gives the leak check's "may see" relation (`visible_keys`) and flex attention's mask_mod
(`evaluate` on two 0-d positions, its tables made once by `lookups`). The language itself, what a
mask is, lives in `ring_impl.masks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ring_impl.masks import EXPR, Expr, MaskSpec, doc_starts_of

DECISION_CHUNK = 1 << 20  # entries of the block mask evaluated at once by block_decision

SKIP, FULL, PARTIAL = "skip", "full", "partial"


def doc_ids(spec: MaskSpec | Sequence[int], pos: torch.Tensor) -> torch.Tensor:
    """Document index of each global position (from a document mask's starts, or the starts
    themselves)."""
    starts = spec.doc_starts if isinstance(spec, MaskSpec) else tuple(spec)
    return (
        torch.searchsorted(
            torch.tensor(starts, dtype=torch.long, device=pos.device), pos, right=True
        )
        - 1
    )


def _block_table(
    size: int, pairs: tuple[tuple[int, int], ...], qb: torch.Tensor, kb: torch.Tensor
) -> torch.Tensor:
    if not pairs:
        return torch.zeros(qb.shape[0], kb.shape[1], dtype=torch.bool, device=qb.device)
    nq, nk = max(p[0] for p in pairs) + 1, max(p[1] for p in pairs) + 1
    # row/col nq, nk: outside
    table = torch.zeros(nq + 1, nk + 1, dtype=torch.bool, device=qb.device)
    idx = torch.tensor(pairs, dtype=torch.long, device=qb.device)
    table[idx[:, 0], idx[:, 1]] = True
    return table[qb.clamp(max=nq), kb.clamp(max=nk)]


Leaf = Callable[[Expr, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class Lookups:
    """Tensors made once for `evaluate` inside a compiled kernel, where a tensor made by the
    function itself does not lower (flex attention's `mask_mod`: `lookups`): for each
    document-starts tuple of an expression the document index and the document's start of every
    position 0..total-1, for each block table its flattened table."""

    docs: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]
    blocks: dict[tuple[int, tuple[tuple[int, int], ...]], tuple[torch.Tensor, int, int]]


def lookups(e: Expr, total: int, device: torch.device | str = "cpu") -> Lookups:
    """The `Lookups` of expression `e` for positions 0..total-1 (relative positions of per-document
    operands are in that range too)."""
    pos = torch.arange(max(1, total), dtype=torch.long, device=device)
    docs = {}
    for starts in doc_starts_of(e):
        ids = doc_ids(starts, pos)
        docs[starts] = (ids, torch.tensor(starts, dtype=torch.long, device=device)[ids])
    blocks = {}
    for node in _nodes(e):
        if node.op == "blocks":
            size, pairs = node.params
            nq = max((p[0] for p in pairs), default=0) + 1
            nk = max((p[1] for p in pairs), default=0) + 1
            qb, kb = (
                torch.arange(nq + 1, device=device).view(-1, 1),
                torch.arange(nk + 1, device=device).view(1, -1),
            )
            blocks[node.params] = (
                _block_table(size, pairs, qb, kb).reshape(-1).contiguous(),
                nq,
                nk,
            )
    return Lookups(docs, blocks)


def _nodes(e: Expr) -> list[Expr]:
    return [e] + [n for a in e.args for n in _nodes(a)]


def _docs(
    starts: tuple[int, ...], pos: torch.Tensor, tables: Lookups | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, document start) of each position."""
    if tables is not None:
        ids, first = tables.docs[starts]
        return ids[pos], first[pos]
    ids = doc_ids(starts, pos)
    return ids, torch.tensor(starts, dtype=torch.long, device=pos.device)[ids]


def _broadcast(a: torch.Size, b: torch.Size) -> torch.Size:
    """`torch.broadcast_shapes` of two shapes, without its Python overhead (a tenth of a small
    case's rank time went there): mask shapes are (Lq, 1), (1, Lk) or 0-d."""
    if a == b:
        return a
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b, strict=True):
        if x != y and x != 1 and y != 1:
            raise RuntimeError(f"shapes {a} and {b} do not broadcast")
        out.append(y if x == 1 else x)
    return torch.Size(out)


def evaluate(
    e: Expr,
    qp: torch.Tensor,
    kp: torch.Tensor,
    leaf: Leaf | None = None,
    tables: Lookups | None = None,
) -> torch.Tensor:
    """Bool mask of the expression for query positions qp (Lq, 1) and key positions kp (1, Lk): (Lq,
    Lk); or for any two broadcastable position tensors, e.g. two 0-d ones (flex attention's
    mask_mod: pointwise ops only, no view of a result whose shape is already right, and with
    `tables` no tensor made here). `leaf` may take over a primitive (return its mask, or None to
    leave it alone): the mutants' hook."""
    shape = _broadcast(qp.shape, kp.shape)
    op = e.op
    if op == "and" or op == "or":
        out = evaluate(e.args[0], qp, kp, leaf, tables)
        for a in e.args[1:]:
            nxt = evaluate(a, qp, kp, leaf, tables)
            out = (out & nxt) if op == "and" else (out | nxt)
        return out
    if op == "not":
        return ~evaluate(e.args[0], qp, kp, leaf, tables)
    # the same document, and the operand on positions relative to its start
    if op == "per-document":
        (dq, sq), (dk, sk) = _docs(e.params[0], qp, tables), _docs(e.params[0], kp, tables)
        return (dq == dk) & evaluate(e.args[0], qp - sq, kp - sk, leaf, tables)
    if leaf is not None:
        got = leaf(e, qp, kp)
        if got is not None:
            return got if got.shape == shape else got.expand(shape)
    if op == "full":
        m = (qp == qp) | (kp == kp)
    elif op == "causal":
        m = kp <= qp
    elif op == "inverse-causal":
        m = kp >= qp
    elif op == "window":
        m = (kp >= qp - e.param("left")) & (kp <= qp + e.param("right"))
    elif op == "chunked":
        c = e.param("size")
        m = (qp // c) == (kp // c)
    elif op == "dilated":
        s, r, o = e.params
        m = ((qp // s) == (kp // s)) & ((qp % s) % r == o) & ((kp % s) % r == o)
    elif op == "prefix":
        m = kp < e.param("length")
    elif op == "document":
        m = _docs(e.params[0], qp, tables)[0] == _docs(e.params[0], kp, tables)[0]
    elif tables is not None:  # blocks, from the flattened table
        size, _ = e.params
        table, nq, nk = tables.blocks[e.params]
        m = table[(qp // size).clamp(max=nq) * (nk + 1) + (kp // size).clamp(max=nk)]
    else:  # blocks
        size, pairs = e.params
        m = _block_table(size, pairs, qp // size, kp // size)
    return m if m.shape == shape else m.expand(shape)


# Small blocks' masks and decisions, remembered: a ring asks for each block's again in every call,
# forward and backward, and the oracle in every sweep. Keyed by the spec object (kept alive in the
# entry, so its id is not reused) and the positions' bytes.
MEMO_ENTRIES = 1 << 14  # the largest block remembered, in mask entries
MEMO_SIZE = 2048  # entries kept; the memo starts afresh when full
_MEMO: dict[tuple, tuple[MaskSpec, object]] = {}


def _memo_key(kind: str, spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor):
    if q_pos.device.type != "cpu" or k_pos.device.type != "cpu":
        return None
    if q_pos.numel() * k_pos.numel() > MEMO_ENTRIES:
        return None
    q, k = q_pos.contiguous().view(-1), k_pos.contiguous().view(-1)
    return (kind, id(spec), q.dtype, q.numpy().tobytes(), k.dtype, k.numpy().tobytes())


def _recall(key, spec: MaskSpec):
    got = _MEMO.get(key) if key is not None else None
    return got[1] if got is not None and got[0] is spec else None


def _remember(key, spec: MaskSpec, value) -> None:
    if key is None:
        return
    if len(_MEMO) >= MEMO_SIZE:
        _MEMO.clear()
    _MEMO[key] = (spec, value)


def allowed(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
    """Bool (len_q, len_k): True where query may attend key. None means everything is allowed."""
    if spec.kind == "none":
        return None
    key = _memo_key("mask", spec, q_pos, k_pos)
    got = _recall(key, spec)
    if got is not None:
        return got.clone()  # the caller may write into its copy
    m = _allowed(spec, q_pos, k_pos)
    _remember(key, spec, m.clone())
    return m


def _allowed(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    qp = q_pos.view(-1, 1)
    kp = k_pos.view(1, -1)
    if spec.kind == "causal":
        return kp <= qp
    if spec.kind == "window":
        return (kp <= qp) & (kp >= qp - int(spec.window))
    if spec.kind == EXPR:
        return evaluate(spec.expr, qp, kp).contiguous()
    same = doc_ids(spec, q_pos).view(-1, 1) == doc_ids(spec, k_pos).view(1, -1)
    return same & (kp <= qp) if spec.causal else same


def block_decision(
    spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int = DECISION_CHUNK
) -> str:
    """SKIP (no query of the block may see any key of it), FULL (every query sees every key) or
    PARTIAL, from global positions. The mask is evaluated a slab of query rows at a time (at most
    `chunk` entries), so the decision never holds more than that, whatever the block's size."""
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return SKIP
    if spec.kind == "none":
        return FULL
    if spec.kind == "causal":
        if bool(k_pos.min() > q_pos.max()):
            return SKIP
        return FULL if bool(k_pos.max() <= q_pos.min()) else PARTIAL
    key = _memo_key("decision", spec, q_pos, k_pos)
    got = _recall(key, spec)
    if got is None:
        got = _decide(spec, q_pos, k_pos, chunk)
        _remember(key, spec, got)
    return got


def _decide(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, chunk: int) -> str:
    """`block_decision` of a mask that is neither none nor causal, a slab of rows at a time."""
    rows = max(1, chunk // k_pos.numel())
    any_seen, all_seen = False, True
    for i in range(0, q_pos.numel(), rows):
        m = allowed(spec, q_pos[i : i + rows], k_pos)
        any_seen = any_seen or bool(m.any())
        all_seen = all_seen and bool(m.all())
        if any_seen and not all_seen:
            return PARTIAL
    return FULL if all_seen else SKIP


def block_is_empty(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """True when no query of the block may see any key of it, so the block can be skipped."""
    return block_decision(spec, q_pos, k_pos) == SKIP


def full_mask(spec: MaskSpec, total: int) -> torch.Tensor | None:
    """The (total, total) mask of the whole sequence, for single-device attention (the oracle,
    tests)."""
    pos = torch.arange(total, dtype=torch.long)
    return allowed(spec, pos, pos)


def visible_keys(spec: MaskSpec, queries: Sequence[int] | torch.Tensor, total: int) -> torch.Tensor:
    """Bool (total,): keys that at least one of `queries` may attend."""
    q = torch.as_tensor(queries, dtype=torch.long).view(-1)
    m = allowed(spec, q, torch.arange(total, dtype=torch.long))
    if m is None:
        return torch.ones(total, dtype=torch.bool)
    return m.any(dim=0)


def empty_rows(spec: MaskSpec, total: int, chunk: int = DECISION_CHUNK) -> torch.Tensor:
    """Bool (total,): queries that may see no key at all (their out is 0 and lse -inf)."""
    keys = torch.arange(total, dtype=torch.long)
    out = torch.zeros(total, dtype=torch.bool)
    if spec.kind == "none" or total == 0:
        return out
    rows = max(1, chunk // max(1, total))
    for i in range(0, total, rows):
        m = allowed(spec, keys[i : i + rows], keys)
        out[i : i + rows] = ~m.any(dim=1)
    return out
