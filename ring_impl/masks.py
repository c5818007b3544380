"""The mask language: attention masks as pure data over global query and key positions.

A mask is a function of global positions only. So one kernel serves every layout and every uneven
split. What a mask allows is computed in `ring_impl.mask_eval`; this module only says what a mask
is. `ring_impl.mask_parse` reads an expression from a case file.

A mask is a `MaskSpec`. The four original kinds (none, causal, window, document) stay as they
were. Old case files load and replay unchanged. Any other mask is kind "expr": an `Expr` tree of
named primitives combined with and / or / not / per-document. Pure data, never code:

  full                       every key
  causal                     k <= q
  inverse-causal             k >= q
  window(left, right)        q - left <= k <= q + right
  chunked(size)              q // size == k // size               (global chunk ids)
  dilated(segment, rate, offset)
                             same segment (q // s == k // s), and both (q mod s) and (k mod s) are
                             = offset (mod rate): a query off the dilation grid sees nothing
  prefix(length)             k < length                          (every query sees the prefix)
  document(starts)           q and k in the same document (starts: sorted, the first 0)
  blocks(size, pairs)        (q // size, k // size) is one of `pairs` (an explicit block table)

  per-document(starts, m)    q and k in the same document, and m holds for their positions relative to
                             the document's start (per-document chunks, prefixes, dilation, ...)

An expression written exactly as an original kind is stored as that kind (`MaskSpec.of`): `{kind:
full}` is `{kind: none}`, `{kind: window, left: 3, right: 0}` is `{kind: window, window: 3}`,
`{and: [{kind: document, starts: S}, {kind: causal}]}` is `{kind: document, doc_starts: S,
causal: true}`.

Rows that see nothing (a query no key is visible to) are allowed: their out is 0, lse is -inf, dq
is 0, and keys no query sees get dk = dv = 0 (README "Masks").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MASK_KINDS = ("none", "causal", "window", "document")  # the original kinds (capability names too)
SPEC_KINDS = (*MASK_KINDS, "expr")
PRIMITIVES: dict[str, tuple[str, ...]] = {  # name -> parameters, in order
    "full": (),
    "causal": (),
    "inverse-causal": (),
    "window": ("left", "right"),
    "chunked": ("size",),
    "dilated": ("segment", "rate", "offset"),
    "prefix": ("length",),
    "document": ("starts",),
    "blocks": ("size", "pairs"),
}
COMBINATORS = ("and", "or", "not", "per-document")
EXPR = "expr"  # the capability of reading a general expression at all (`MaskSpec.expr`)
# a window that reaches right of the diagonal (window(l, r) with r > 0): a capability of its own,
# because flash-attn-style rings take a causal (left, 0) window in every layout but a two-sided one
# only where each rank's queries and keys line up (bottom-right aligned), which an all-gather ring's
# pieces do not
WINDOW_RIGHT = "window-right"
# every capability name a mask can need: an implementation declares the ones it supports
MASK_FEATURES = tuple(dict.fromkeys((*MASK_KINDS, EXPR, *PRIMITIVES, WINDOW_RIGHT, *COMBINATORS)))
MAX_BLOCK_TABLE = 4096  # entries of a blocks() table
MAX_MASK_PARAM = 2**40  # every mask parameter (positions, sizes, counts): far inside int64


@dataclass(frozen=True)
class Expr:
    """A mask expression: a primitive (`op` in PRIMITIVES, `params` its values in order) or a
    combinator (`op` in COMBINATORS, `args` its operands; `not` has exactly one; `per-document` has
    one and its document starts as `params`)."""

    op: str
    params: tuple[Any, ...] = ()
    args: tuple[Expr, ...] = ()

    def __post_init__(self) -> None:
        if self.op in COMBINATORS:
            if self.op == "per-document":
                if len(self.args) != 1 or len(self.params) != 1:
                    raise ValueError("per-document takes its document starts and exactly one mask")
                object.__setattr__(self, "params", _checked("document", self.params))
                return
            if self.params:
                raise ValueError(f"{self.op} takes operands, not parameters")
            if self.op == "not" and len(self.args) != 1:
                raise ValueError(f"not takes exactly one operand, got {len(self.args)}")
            if self.op != "not" and len(self.args) < 1:
                raise ValueError(f"{self.op} needs at least one operand")
            return
        if self.op not in PRIMITIVES:
            raise ValueError(
                f"unknown mask primitive {self.op!r}; expected one of "
                f"{', '.join(PRIMITIVES)} "
                f"(or and / or / not)"
            )
        if self.args:
            raise ValueError(f"{self.op} takes parameters, not operands")
        names = PRIMITIVES[self.op]
        if len(self.params) != len(names):
            raise ValueError(
                f"{self.op} takes {len(names)} parameter(s) ({', '.join(names)}), got "
                f"{len(self.params)}"
            )
        object.__setattr__(self, "params", _checked(self.op, self.params))

    def param(self, name: str) -> Any:
        return self.params[PRIMITIVES[self.op].index(name)]

    def __str__(self) -> str:
        """The compact one-line form, e.g. `causal&(chunked(8)|prefix(3))`."""
        if self.op == "not":
            return f"!{_paren(self.args[0], 'not')}"
        if self.op == "per-document":
            return f"perdoc({len(self.params[0])})[{self.args[0]}]"
        if self.op in ("and", "or"):
            sym = "&" if self.op == "and" else "|"
            return sym.join(_paren(a, self.op) for a in self.args)
        if self.op == "document":
            return f"doc({len(self.param('starts'))})"
        if self.op == "blocks":
            return f"blocks({self.param('size')},{len(self.param('pairs'))})"
        return f"{self.op}({','.join(str(p) for p in self.params)})" if self.params else self.op

    def leaves(self) -> list[Expr]:
        """The primitives of the expression, left to right."""
        if self.op in COMBINATORS:
            return [leaf for a in self.args for leaf in a.leaves()]
        return [self]

    def combinators(self) -> set[str]:
        if self.op not in COMBINATORS:
            return set()
        return {self.op}.union(*(a.combinators() for a in self.args))

    def size(self) -> int:
        """Nodes in the tree (the shrink order's measure of complexity)."""
        return 1 + sum(a.size() for a in self.args)


def _paren(e: Expr, parent: str) -> str:
    s = str(e)
    return f"({s})" if e.op in ("and", "or") and (e.op != parent or parent == "not") else s


def _int(op: str, name: str, v: Any, lo: int) -> int:
    if not (isinstance(v, int) and not isinstance(v, bool)) or not lo <= v <= MAX_MASK_PARAM:
        raise ValueError(f"{op}: {name} must be an integer in [{lo}, 2**40], got {v!r}")
    return int(v)


def _checked(op: str, params: tuple[Any, ...]) -> tuple[Any, ...]:
    """The parameters validated and normalised (tuples, ints); ValueError naming the bad one."""
    if op == "window":
        return _int(op, "left", params[0], 0), _int(op, "right", params[1], 0)
    if op in ("chunked", "prefix"):
        return (_int(op, PRIMITIVES[op][0], params[0], 1 if op == "chunked" else 0),)
    if op == "dilated":
        seg, rate = _int(op, "segment", params[0], 1), _int(op, "rate", params[1], 1)
        off = _int(op, "offset", params[2], 0)
        if off >= rate:
            raise ValueError(f"dilated: offset must be < rate ({rate}), got {off}")
        return seg, rate, off
    if op == "document":
        starts = params[0]
        if not isinstance(starts, (list, tuple)) or not starts:
            raise ValueError(
                f"document: starts must be a non-empty list of integers, got {starts!r}"
            )
        starts = tuple(_int(op, "starts", s, 0) for s in starts)
        if starts[0] != 0:
            raise ValueError(f"document: starts must begin with 0, got {list(starts)}")
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise ValueError(f"document: starts must be strictly increasing, got {list(starts)}")
        return (starts,)
    if op == "blocks":
        size, pairs = _int(op, "size", params[0], 1), params[1]
        if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs
        ):
            raise ValueError(
                f"blocks: pairs must be a list of [query block, key block] pairs, got {pairs!r}"
            )
        pairs = tuple(
            sorted({(_int(op, "pairs", p[0], 0), _int(op, "pairs", p[1], 0)) for p in pairs})
        )
        if (
            pairs
            and (max(p[0] for p in pairs) + 1) * (max(p[1] for p in pairs) + 1) > MAX_BLOCK_TABLE
        ):
            raise ValueError(f"blocks: the table may have at most {MAX_BLOCK_TABLE} entries")
        return size, pairs
    return ()


def prim(op: str, *params: Any) -> Expr:
    """A primitive, e.g. `prim("window", 3, 0)`."""
    return Expr(op, tuple(params))


def and_(*args: Expr) -> Expr:
    return Expr("and", args=tuple(args))


def or_(*args: Expr) -> Expr:
    return Expr("or", args=tuple(args))


def not_(arg: Expr) -> Expr:
    return Expr("not", args=(arg,))


@dataclass(frozen=True)
class MaskSpec:
    """kind: none | causal | window | document (the original kinds) | expr.

    window: query i sees keys j with i - window <= j <= i (flash-attn's window_size=(window, 0)).
    doc_starts: for document masks, sorted global start positions of the packed documents
    (the first must be 0); attention stays inside a document, causal or not (`causal`).
    expr: for kind expr, the expression (`Expr`); build one with `MaskSpec.of(expr)`.
    """

    kind: str = "none"
    window: int | None = None
    doc_starts: tuple[int, ...] = field(default_factory=tuple)
    causal: bool = True
    expr: Expr | None = None

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise ValueError(
                f"unknown mask kind {self.kind!r}; expected one of {', '.join(SPEC_KINDS)}"
            )
        if self.kind == "window" and (self.window is None or int(self.window) < 0):
            raise ValueError(f"window mask needs a window >= 0, got {self.window!r}")
        if self.kind == "document":
            starts = tuple(int(s) for s in self.doc_starts)
            if not starts or starts[0] != 0:
                raise ValueError(
                    f"document mask needs doc_starts beginning with 0, got {list(starts)}"
                )
            if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
                raise ValueError(f"doc_starts must be strictly increasing, got {list(starts)}")
            object.__setattr__(self, "doc_starts", starts)
        if (self.kind == EXPR) != isinstance(self.expr, Expr):
            raise ValueError("a mask of kind expr needs an expression (and only it has one)")

    @staticmethod
    def of(e: Expr) -> MaskSpec:
        """The spec of an expression: one of the original kinds when it says exactly that, else kind
        expr."""
        legacy = _as_legacy(e)
        return legacy if legacy is not None else MaskSpec(EXPR, expr=e)

    def expression(self) -> Expr:
        """This mask as an expression (the original kinds are sugar for one)."""
        if self.kind == EXPR:
            return self.expr
        if self.kind == "none":
            return prim("full")
        if self.kind == "causal":
            return prim("causal")
        if self.kind == "window":
            return prim("window", int(self.window), 0)
        doc = prim("document", self.doc_starts)
        return and_(doc, prim("causal")) if self.causal else doc

    @property
    def is_causal(self) -> bool:
        """True when no query may see a later key."""
        if self.kind == EXPR:
            return _causal(self.expr)
        return self.kind in ("causal", "window") or (self.kind == "document" and self.causal)

    @property
    def is_full(self) -> bool:
        """True when every query sees every key (no mask at all)."""
        return self.kind == "none"

    def needs(self) -> frozenset[str]:
        """The capability names an implementation must declare to run this mask."""
        if self.kind != EXPR:
            return frozenset({self.kind})
        leaves = self.expr.leaves()
        right = any(leaf.op == "window" and leaf.params[1] > 0 for leaf in leaves)
        return frozenset(
            {
                EXPR,
                *(leaf.op for leaf in leaves),
                *self.expr.combinators(),
                *([WINDOW_RIGHT] * right),
            }
        )

    def describe(self) -> str:
        """The case summary's mask word: none, causal, window5, doc3nc, or the expression."""
        if self.kind == "window":
            return f"window{self.window}"
        if self.kind == "document":
            return f"doc{len(self.doc_starts)}{'' if self.causal else 'nc'}"
        if self.kind == EXPR:
            return str(self.expr)
        return self.kind

    def to_dict(self) -> dict:
        if self.kind == "none" or self.kind == "causal":
            return {"kind": self.kind}
        if self.kind == "window":
            return {"kind": "window", "window": int(self.window)}
        if self.kind == EXPR:
            return expr_to_dict(self.expr)
        return {
            "kind": "document",
            "doc_starts": list(self.doc_starts),
            "causal": bool(self.causal),
        }


def _causal(e: Expr) -> bool:
    if e.op == "per-document":  # positions relative to their document keep their order within it
        return _causal(e.args[0])
    if e.op == "causal":
        return True
    if e.op == "window":
        return e.param("right") == 0
    if e.op == "and":
        return any(_causal(a) for a in e.args)
    if e.op == "or":
        return all(_causal(a) for a in e.args)
    return False


def _as_legacy(e: Expr) -> MaskSpec | None:
    if e.op == "full":
        return MaskSpec("none")
    if e.op == "causal":
        return MaskSpec("causal")
    if e.op == "window" and e.param("right") == 0:
        return MaskSpec("window", window=e.param("left"))
    if e.op == "document":
        return MaskSpec("document", doc_starts=e.param("starts"), causal=False)
    if e.op == "and" and len(e.args) == 2:
        ops = sorted(a.op for a in e.args)
        if ops == ["causal", "document"]:
            doc = next(a for a in e.args if a.op == "document")
            return MaskSpec("document", doc_starts=doc.param("starts"), causal=True)
    return None


# -- the data form (a case file's `mask:`; ring_impl.mask_parse reads it back) -----------------


def expr_to_dict(e: Expr) -> dict:
    """Plain data: `{kind: NAME, param: value, ...}` for a primitive, `{and: [...]}`, `{or: [...]}`,
    `{not: {...}}` for a combinator."""
    if e.op == "not":
        return {"not": expr_to_dict(e.args[0])}
    if e.op == "per-document":
        return {"per-document": {"starts": list(e.params[0]), "mask": expr_to_dict(e.args[0])}}
    if e.op in COMBINATORS:
        return {e.op: [expr_to_dict(a) for a in e.args]}
    d: dict[str, Any] = {"kind": e.op}
    for name, v in zip(PRIMITIVES[e.op], e.params, strict=True):
        if name == "pairs":
            v = [list(p) for p in v]
        elif isinstance(v, tuple):
            v = list(v)
        d[name] = v
    return d


def _map_nodes(e: Expr, fn) -> Expr:
    """`fn` applied to every node, operands first."""
    if e.op in COMBINATORS:
        e = Expr(e.op, e.params, tuple(_map_nodes(a, fn) for a in e.args))
    return fn(e)


def doc_starts_of(e: Expr) -> list[tuple[int, ...]]:
    """The document starts of every document primitive and per-document combinator of `e`."""
    own = [e.params[0]] if e.op in ("document", "per-document") else []
    return own + [s for a in e.args for s in doc_starts_of(a)]


def fit(spec: MaskSpec, total: int) -> MaskSpec:
    """The mask for a sequence cut to `total` tokens: document starts at or beyond it dropped."""
    if spec.kind == "document":
        return MaskSpec(
            "document",
            doc_starts=tuple(s for s in spec.doc_starts if s < total),
            causal=spec.causal,
        )
    if spec.kind != EXPR:
        return spec

    def cut(node: Expr) -> Expr:
        if node.op not in ("document", "per-document"):
            return node
        return Expr(node.op, (tuple(s for s in node.params[0] if s < max(1, total)),), node.args)

    return MaskSpec.of(_map_nodes(spec.expr, cut))
