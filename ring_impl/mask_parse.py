"""Reading a mask expression from plain data: a case file's `mask:` mapping.

It is the inverse of `ring_impl.masks.expr_to_dict`. The data comes from files, so its depth and size
are bounded. A ValueError names where the bad part is, e.g. `and[1]: chunked: size must be ...`.
"""

from __future__ import annotations

from typing import Any

from ring_impl.masks import COMBINATORS, PRIMITIVES, Expr, not_

MAX_DEPTH = 8
MAX_NODES = 64


def _at(where: str, msg: str) -> str:
    return f"{where}: {msg}" if where else msg


def expr_from_dict(d: Any, where: str = "", depth: int = 0) -> Expr:
    """An expression from plain data; ValueError naming where (e.g. `and[1]: chunked: size must be
    ...`)."""
    if depth > MAX_DEPTH:
        raise ValueError(_at(where, f"nested deeper than {MAX_DEPTH}"))
    if not isinstance(d, dict):
        raise ValueError(
            _at(where, f"must be a mapping like {{kind: causal}} or {{and: [...]}}, got {d!r}")
        )
    combo = [k for k in COMBINATORS if k in d]
    if combo:
        if len(d) != 1:
            keys = sorted(map(str, d))
            raise ValueError(
                _at(where, f"a combinator mapping has exactly one key ({combo[0]}), got {keys}")
            )
        op = combo[0]
        if op == "not":
            return not_(expr_from_dict(d["not"], f"{where}.not" if where else "not", depth + 1))
        if op == "per-document":
            path = f"{where}.per-document" if where else "per-document"
            body = d[op]
            if not isinstance(body, dict) or set(body) != {"starts", "mask"}:
                raise ValueError(_at(path, f"must be a mapping with starts and mask, got {body!r}"))
            inner = expr_from_dict(body["mask"], f"{path}.mask", depth + 1)
            try:
                return Expr(op, (body["starts"],), (inner,))
            except ValueError as e:
                raise ValueError(_at(path, str(e))) from None
        items = d[op]
        if not isinstance(items, list) or not items:
            raise ValueError(
                _at(
                    f"{where}.{op}" if where else op,
                    f"must be a non-empty list of masks, got {items!r}",
                )
            )
        path = f"{where}.{op}" if where else op
        e = Expr(
            op,
            args=tuple(expr_from_dict(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(items)),
        )
        if e.size() > MAX_NODES:
            raise ValueError(_at(where, f"more than {MAX_NODES} nodes"))
        return e
    op = d.get("kind")
    if op not in PRIMITIVES:
        raise ValueError(
            _at(
                where,
                f"unknown kind {op!r}; expected one of {', '.join(PRIMITIVES)} "
                f"(or a mapping with one key: and, or, not)",
            )
        )
    names = PRIMITIVES[op]
    unknown = set(d) - {"kind", *names}
    if unknown:
        raise ValueError(
            _at(
                where,
                f"unknown key(s) {', '.join(sorted(map(str, unknown)))} for "
                f"{op} "
                f"(takes {', '.join(names) or 'nothing'})",
            )
        )
    missing = [n for n in names if n not in d]
    if missing:
        raise ValueError(_at(where, f"{op} needs {', '.join(missing)}"))
    try:
        return Expr(op, tuple(d[n] for n in names))
    except ValueError as e:
        raise ValueError(_at(where, f"{e}")) from None
