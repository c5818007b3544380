"""The case schema: the values each field of a case may take, and the checks that enforce them.

`validate` checks a built case and names the first bad field. `mask_from_dict` reads a case file's
`mask:` mapping. Every message starts with `case field '<name>'`, so a user finds the line to fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness import limits, serving_case
from harness.calls import CALLS, INPUT_FORMS
from harness.dtypes import DTYPES
from harness.errors import HarnessError
from harness.faults.schema import parse_faults
from harness.limits import MAX_WORLD
from ring_impl.layouts import LAYOUTS
from ring_impl.mask_parse import expr_from_dict
from ring_impl.masks import MASK_KINDS, MaskSpec, doc_starts_of

# Annotations only: harness.case builds on this module.
if TYPE_CHECKING:
    from harness.case import Case

# normal, large and near-tie stress the merge; the last three are the magnitudes of trained models
# (harness.inputs)
VALUE_KINDS = ("normal", "large", "near-tie", "outliers", "qk-overflow", "sink")
TENSORS = ("out", "dq", "dk", "dv", "lse", "dsinks")
LEGACY_MASK_KEYS = {"kind", "window", "doc_starts", "causal"}


def _need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise HarnessError(f"case field '{name}': {msg}")


def validate(c: Case) -> None:
    """Check every field, and raise HarnessError naming the first bad one."""
    _check_sizes(c)
    _check_layout_and_mask(c)
    _check_numerics(c)
    _check_impl_and_faults(c)
    _check_tolerance(c)
    _check_call(c)
    _check_variants(c)
    if c.serving is not None:
        serving_case.check(c)


def _check_sizes(c: Case) -> None:
    """The world, the heads, the head dim and the per-rank lengths, each within its range."""
    for name in ("world_size", "group_offset", "batch", "heads_q", "heads_kv", "head_dim"):
        limits.case_field(name, getattr(c, name))
    _need(
        c.pool_size <= MAX_WORLD,
        "group_offset",
        f"group_offset + world_size must be <= {MAX_WORLD} ranks, got {c.pool_size}",
    )
    _need(
        c.heads_q % c.heads_kv == 0,
        "heads_kv",
        f"heads_q ({c.heads_q}) must be a multiple of heads_kv ({c.heads_kv})",
    )
    _need(isinstance(c.seq_lens, tuple), "seq_lens", f"must be a list, got {c.seq_lens!r}")
    each = limits.CASE["seq_lens"]
    _need(
        all(each.holds(n) for n in c.seq_lens),
        "seq_lens",
        f"every entry must be {each.words()}, got {list(c.seq_lens)!r}",
    )
    _need(
        len(c.seq_lens) == c.world_size,
        "seq_lens",
        f"has {len(c.seq_lens)} entries but world_size is {c.world_size}",
    )
    _need(c.total_len >= 1, "seq_lens", "the total sequence length must be at least 1")
    limits.case_field("total_len", c.total_len)


def _check_layout_and_mask(c: Case) -> None:
    """The layout, and a mask whose documents start inside the sequence."""
    _need(
        c.layout in LAYOUTS,
        "layout",
        f"unknown layout {c.layout!r}; expected one of {', '.join(LAYOUTS)}",
    )
    _need(isinstance(c.mask, MaskSpec), "mask", f"must be a mask mapping, got {c.mask!r}")
    for starts in doc_starts_of(c.mask.expression()):
        _need(
            starts[-1] < c.total_len,
            "mask",
            f"document start {starts[-1]} is beyond the sequence (length {c.total_len})",
        )


def _check_numerics(c: Case) -> None:
    """The dtype, the softmax scale, the value distribution and the seed."""
    _need(
        c.dtype in DTYPES,
        "dtype",
        f"unknown dtype {c.dtype!r}; expected one of {', '.join(DTYPES)}",
    )
    if c.softmax_scale is not None:
        limits.case_field("softmax_scale", c.softmax_scale)
    _need(
        c.values in VALUE_KINDS,
        "values",
        f"unknown value distribution {c.values!r}; expected one of {', '.join(VALUE_KINDS)}",
    )
    limits.case_field("seed", c.seed)


def _check_impl_and_faults(c: Case) -> None:
    """The implementation's name, and the faults against the world size."""
    _need(
        isinstance(c.impl, str) and c.impl != "",
        "impl",
        f"must be a non-empty string, got {c.impl!r}",
    )
    _need(
        isinstance(c.faults, tuple), "faults", f"must be a list of fault mappings, got {c.faults!r}"
    )
    # It raises naming the field, e.g. 'faults[1].index'.
    parse_faults(c.faults, c.world_size)


def _check_tolerance(c: Case) -> None:
    """A mapping of tensor names to positive factors."""
    _need(isinstance(c.tolerance, dict), "tolerance", f"must be a mapping, got {c.tolerance!r}")
    for k, v in c.tolerance.items():
        _need(
            k in TENSORS,
            "tolerance",
            f"unknown tensor {k!r}; expected some of {', '.join(TENSORS)}",
        )
        limits.case_field("tolerance", v, f"factor for {k}")


def _check_call(c: Case) -> None:
    """How the model calls the ring, the form of its inputs, and the deadline."""
    _need(c.call in CALLS, "call", f"unknown call {c.call!r}; expected one of {', '.join(CALLS)}")
    _need(
        c.inputs in INPUT_FORMS,
        "inputs",
        f"unknown input form {c.inputs!r}; expected one of {', '.join(INPUT_FORMS)}",
    )
    limits.case_field("deadline_s", c.deadline_s)


def _check_variants(c: Case) -> None:
    """The attention variants: a value head dim, a cap, ALiBi, and one sink per query head."""
    if c.head_dim_v is not None:
        limits.case_field("head_dim_v", c.head_dim_v)
    if c.softcap is not None:
        limits.case_field("softcap", c.softcap)
    _need(isinstance(c.alibi, bool), "alibi", f"must be true or false, got {c.alibi!r}")
    if c.sinks is None:
        return
    _need(
        isinstance(c.sinks, tuple) and len(c.sinks) == c.heads_q,
        "sinks",
        f"must be a list of one logit per query head ({c.heads_q}), got {c.sinks!r}",
    )
    for s in c.sinks:
        limits.case_field("sinks", s, "every logit")


def mask_from_dict(d: Any) -> MaskSpec:
    """A mask: one of the original kinds, or an expression of primitives (ring_impl.masks).

    The original kinds are `{kind: causal}`, `{kind: window, window: 3}` and `{kind: document,
    doc_starts: [...], causal: false}`. An expression combines primitives with and, or and not, e.g.
    `{and: [{kind: causal}, {kind: chunked, size: 8}]}`.
    """
    if not isinstance(d, dict):
        raise HarnessError(f"case field 'mask': must be a mapping like {{kind: causal}}, got {d!r}")
    if d.get("kind", "none") not in MASK_KINDS or not set(d) <= LEGACY_MASK_KEYS:
        try:
            return MaskSpec.of(expr_from_dict(d))
        except ValueError as e:
            raise HarnessError(f"case field 'mask': {e}") from None
    kind = d.get("kind", "none")
    if kind not in MASK_KINDS:
        raise HarnessError(
            f"case field 'mask': unknown kind {kind!r}; expected one of {', '.join(MASK_KINDS)}"
        )
    window = d.get("window")
    if kind == "window":
        limits.case_field("mask", window, "window")
    starts = d.get("doc_starts", [])
    if kind == "document" and not isinstance(starts, list):
        raise HarnessError(f"case field 'mask': doc_starts must be a list, got {starts!r}")
    for i, s in enumerate(starts if kind == "document" else ()):
        limits.case_field("mask", s, f"doc_starts[{i}]")
    causal = d.get("causal", True)
    if not isinstance(causal, bool):
        raise HarnessError(f"case field 'mask': causal must be true or false, got {causal!r}")
    try:
        return MaskSpec(
            kind=kind,
            window=window if kind == "window" else None,
            doc_starts=tuple(starts) if kind == "document" else (),
            causal=causal,
        )
    except ValueError as e:
        raise HarnessError(f"case field 'mask': {e}") from None
