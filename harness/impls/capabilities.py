"""The capability rule, written once: which features of a run an implementation does not declare.

Both sides call `missing_features`: the case side before a run (`unsupported`, for the check and the
fault battery), and the rank side inside a run (the adapters' `require_supported`). Also here are
the nearest supported variant of a case (`adapt`) and the capability matrix. The matrix shows, per
feature, declared, passed and failed, and what an undeclared feature does when probed. docs/api.md
lists the feature keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from harness.calls import needs_backward, useful_form
from harness.context import PLAIN_VARIANT, VARIANT_WORDS, VARIANTS, Capabilities
from harness.serving_case import seq_lens as serving_seq_lens
from harness.serving_case import shape_of
from ring_impl.layouts import split_lengths
from ring_impl.masks import MASK_FEATURES, MaskSpec, fit
from ring_impl.serving import Requests

# Annotations only: the adapters import this module inside the ranks.
if TYPE_CHECKING:
    from harness.case import Case


def missing_features(
    caps: Capabilities,
    *,
    layout: str,
    mask_kind: str | MaskSpec,
    dtype: str,
    world_size: int,
    heads_q: int,
    heads_kv: int,
    lengths: Sequence[int],
    head_dim: int,
    subgroup: bool | None,
    device: str | None,
    call: str | None = None,
    inputs: str | None = None,
    variants: Sequence[str] = (),
    serving: Requests | None = None,
) -> list[str]:
    """The feature keys of a run that `caps` does not declare, in a fixed order.

    An empty list means the run is supported. A key is a `kind:value` string such as
    "layout:zigzag", or a bare flag such as "uneven" (docs/api.md lists them). `subgroup`, `device`,
    `call` and `inputs` may be None when they are not known yet. They are then not checked.
    `subgroup` means the ring is not global ranks 0..W-1, and `device` is the tensors' device.
    `mask_kind` is one name, or a mask. A mask needs every capability name in `MaskSpec.needs`: an
    expression needs "expr", its primitives and its combinators.
    """
    missing = []
    if layout not in caps.layouts:
        missing.append(f"layout:{layout}")
    needs = mask_kind.needs() if isinstance(mask_kind, MaskSpec) else {mask_kind}
    missing.extend(f"mask:{n}" for n in MASK_FEATURES if n in needs and n not in caps.masks)
    if dtype not in caps.dtypes:
        missing.append(f"dtype:{dtype}")
    lo, hi = caps.world_sizes
    if not lo <= world_size <= hi:
        missing.append(f"world:{world_size}")
    if heads_q != heads_kv and not caps.gqa:
        missing.append("gqa" if heads_kv > 1 else "mqa")
    if caps.heads_divisible_by_world and (heads_q % world_size or heads_kv % world_size):
        missing.append("heads")
    if len({int(n) for n in lengths}) > 1 and not caps.uneven:
        missing.append("uneven")
    if any(int(n) == 0 for n in lengths) and not caps.idle_ranks:
        missing.append("idle")
    if layout == "zigzag" and not caps.zigzag_odd and odd_lengths(lengths):
        missing.append("zigzag-odd")
    if caps.head_dims is not None and head_dim not in caps.head_dims:
        missing.append(f"head_dim:{head_dim}")
    if subgroup and not caps.subgroups:
        missing.append("subgroup")
    if device is not None and device not in caps.devices:
        missing.append(f"device:{device}")
    if call is not None and needs_backward(call) and not caps.backward:
        missing.append("backward")
    if inputs is not None and inputs not in caps.input_forms:
        missing.append(f"inputs:{inputs}")
    missing.extend(f"variant:{v}" for v in VARIANTS if v in variants and v not in caps.variants)
    missing.extend(f for f in serving_features(serving) if not _declares(caps, f))
    return missing


def serving_features(req: Requests | None) -> list[str]:
    """The inference shape's feature keys: shape:prefill or shape:decode, kv:D, queries:Q."""
    if req is None:
        return []
    paged = ["inputs:paged"] if req.page_size else []
    return [f"shape:{shape_of(req)}", f"kv:{req.kv}", f"queries:{req.queries}", *paged]


def _declares(caps: Capabilities, feature: str) -> bool:
    kind, _, value = feature.partition(":")
    field = {"shape": "shapes", "kv": "kv_layouts", "queries": "queries", "inputs": "input_forms"}
    return value in getattr(caps, field[kind])


def feature_words(
    feature: str,
    caps: Capabilities,
    *,
    heads_q: int | None = None,
    heads_kv: int | None = None,
    lengths: Sequence[int] | None = None,
    global_ranks: Sequence[int] | None = None,
    world_size: int | None = None,
) -> str:
    """A missing feature key in words for a one-line refusal, e.g. "uneven split [5, 1]"."""
    kind, _, value = feature.partition(":")
    if world_size is None and lengths is not None:
        world_size = len(lengths)
    if kind == "world":
        lo, hi = caps.world_sizes
        return f"world size {value} (supports {lo}..{hi})"
    if kind in ("gqa", "mqa"):
        return f"GQA ({heads_q} query heads, {heads_kv} kv heads)"
    if kind == "heads":
        return f"heads {heads_q}/{heads_kv} not divisible by W={world_size}"
    if kind == "uneven":
        return f"uneven split {[int(n) for n in lengths or ()]}"
    if kind == "idle":
        return f"idle ranks (a rank with no token: {[int(n) for n in lengths or ()]})"
    if kind == "zigzag-odd":
        return f"zigzag with an odd local length {[int(n) for n in lengths or ()]}"
    if kind == "subgroup":
        return (
            f"ring in a subgroup (global ranks {list(global_ranks or ())}): "
            "runs only on the whole default process group"
        )
    if kind == "device":
        return f"device {value} (supports {', '.join(sorted(caps.devices))})"
    if kind == "backward":
        return "a backward pass (a training or checkpointed call)"
    if kind == "inputs":
        return f"input form {value} (supports {', '.join(sorted(caps.input_forms))})"
    if kind == "variant":
        return VARIANT_WORDS[value]
    if kind == "shape":
        return f"the {value} shape (queries are new tokens over a KV cache)"
    if kind == "kv":
        return f"a KV cache spread {value} (supports {', '.join(sorted(caps.kv_layouts))})"
    if kind == "queries":
        return f"{value} queries (supports {', '.join(sorted(caps.queries))})"
    return f"{kind} {value}" if value else kind  # layout, mask, dtype, head_dim


def odd_lengths(lengths: Sequence[int]) -> bool:
    """Whether some local length is odd. In the zigzag layout, a rank's two chunks then differ in
    size.
    """
    return any(int(n) % 2 for n in lengths)


def even_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    """Every odd local length rounded up to the next even one.

    An even split of N becomes one of N rounded up to a multiple of 2W.
    """
    return tuple(int(n) + int(n) % 2 for n in lengths)


def divisible_heads(heads_q: int, heads_kv: int, world_size: int) -> tuple[int, int]:
    """The nearest (heads_q, heads_kv), rounded up, that `world_size` divides both of.

    The kv heads go up to a multiple of W, and the query heads up to a multiple of those. GQA and
    MQA stay grouped, with at least 2 query heads per kv head. MHA stays MHA. For example, (4, 1) at
    W=3 becomes (6, 3), and (2, 2) at W=4 becomes (4, 4).
    """
    kv = -(-heads_kv // world_size) * world_size
    q = -(-heads_q // kv) * kv
    if heads_q > heads_kv and q == kv:
        q = 2 * kv
    return q, kv


def case_features(c: Case) -> list[str]:
    """The features a case exercises, as `kind:value` strings: the capability matrix's rows."""
    feats = [
        *([f"layout:{c.layout}"] if c.serving is None else []),
        *(f"mask:{n}" for n in MASK_FEATURES if n in c.mask.needs()),
        f"dtype:{c.dtype}",
        f"world:{c.world_size}",
    ]
    if c.heads_q != c.heads_kv:
        feats.append("gqa" if c.heads_kv > 1 else "mqa")
    if c.heads_q % c.world_size or c.heads_kv % c.world_size:
        feats.append("heads")
    if len(set(c.seq_lens)) > 1:
        feats.append("uneven")
    if 0 in c.seq_lens:
        feats.append("idle")
    if c.layout == "zigzag" and odd_lengths(c.seq_lens):
        feats.append("zigzag-odd")
    if c.group_offset:
        feats.append("subgroup")
    if needs_backward(c.call):
        feats.append("backward")
    if c.call != "train":
        feats.append(f"call:{c.call}")
    if c.inputs != "contiguous":
        feats.append(f"inputs:{c.inputs}")
    feats.extend(f"variant:{v}" for v in c.variants)
    feats.extend(serving_features(c.serving))
    return feats


def unsupported(caps: Capabilities, c: Case, device: str | None = None) -> list[str]:
    """The features of the case that the implementation does not declare. Empty: fully supported.

    The tensors' device is checked only when given. A case does not name one: the pool decides it.
    """
    return missing_features(
        caps,
        layout=c.layout,
        mask_kind=c.mask,
        dtype=c.dtype,
        world_size=c.world_size,
        heads_q=c.heads_q,
        heads_kv=c.heads_kv,
        lengths=c.seq_lens,
        head_dim=c.head_dim,
        subgroup=bool(c.group_offset),
        device=device,
        call=c.call,
        inputs=c.inputs,
        variants=c.variants,
        serving=c.serving,
    )


def declare(caps: Capabilities, feature: str) -> Capabilities:
    """`caps` with one more feature declared, a key of `missing_features`.

    A probe of that feature adapts the rest of its case to these capabilities.
    """
    import dataclasses

    kind, _, value = feature.partition(":")
    r = dataclasses.replace
    if kind == "layout":
        return r(caps, layouts=caps.layouts | {value})
    if kind == "mask":
        return r(caps, masks=caps.masks | {value})
    if kind == "dtype":
        return r(caps, dtypes=caps.dtypes | {value})
    if kind == "world":
        lo, hi = caps.world_sizes
        return r(caps, world_sizes=(min(lo, int(value)), max(hi, int(value))))
    if kind == "head_dim":
        return r(caps, head_dims=(*(caps.head_dims or ()), int(value)))
    if kind == "device":
        return r(caps, devices=caps.devices | {value})
    if kind == "inputs":
        return r(caps, input_forms=caps.input_forms | {value})
    if kind == "variant":
        return r(caps, **{value: True})
    if kind == "shape":
        return r(caps, shapes=caps.shapes | {value})
    if kind == "kv":
        return r(caps, kv_layouts=caps.kv_layouts | {value})
    if kind == "queries":
        return r(caps, queries=caps.queries | {value})
    flags = {
        "gqa": ("gqa", True),
        "mqa": ("gqa", True),
        "heads": ("heads_divisible_by_world", False),
        "uneven": ("uneven", True),
        "idle": ("idle_ranks", True),
        "zigzag-odd": ("zigzag_odd", True),
        "subgroup": ("subgroups", True),
        "backward": ("backward", True),
    }
    if kind not in flags:
        raise ValueError(f"unknown feature {feature!r}")
    name, value_ = flags[kind]
    return r(caps, **{name: value_})


# What one probe may change at once: a feature's dimension. An expression mask needs several
# capability names (mask:expr and its primitives and combinators) and an idle rank is an uneven
# split, so a probe changes one dimension (the mask, the split, the heads) and every undeclared name
# it needs there.
_DIMENSIONS = {
    "mask": "mask",
    "uneven": "split",
    "idle": "split",
    "zigzag-odd": "split",
    "gqa": "heads",
    "mqa": "heads",
    "heads": "heads",
    "backward": "call",
    "inputs": "inputs",
    "shape": "serving",
    "kv": "serving",
    "queries": "serving",
}


def dimension(feature: str) -> str:
    """The dimension a feature key belongs to ('mask', 'split', 'heads'), or the key itself."""
    return _DIMENSIONS.get(feature.partition(":")[0], feature)


def isolated_probe(caps: Capabilities, c: Case, feature: str) -> Case | None:
    """`c` with every undeclared feature outside `feature`'s dimension adapted away.

    A run of it then probes that one dimension on an otherwise declared case, e.g. an undeclared
    mask expression, or an idle rank. None when no such case exists.
    """
    dim = dimension(feature)
    wider = caps
    for f in unsupported(caps, c):
        if dimension(f) == dim:
            wider = declare(wider, f)
    probe = adapt(wider, c)
    if probe is None:
        return None
    left = unsupported(caps, probe)
    return probe if feature in left and all(dimension(f) == dim for f in left) else None


# Nearest declared substitutes, best first: a case that uses an undeclared feature is adapted to the
# first of these the implementation declares, keeping its world size, split and values where it can.
LAYOUT_FALLBACK = {
    "zigzag": ("contiguous", "striped"),
    "striped": ("contiguous", "zigzag"),
    "contiguous": ("zigzag", "striped"),
}
DTYPE_FALLBACK = {"fp16": ("bf16", "fp32"), "bf16": ("fp16", "fp32"), "fp32": ("bf16", "fp16")}


def _mask_fallbacks(mask: MaskSpec) -> tuple[MaskSpec, ...]:
    """The masks to try instead of an undeclared one, best first.

    - window -> causal
    - a causal document mask -> causal, then none
    - a bidirectional document mask -> none, then causal
    - a causal expression -> causal, then none
    - any other expression -> none, then causal
    """
    causal, none = MaskSpec("causal"), MaskSpec("none")
    if mask.kind == "window" or (mask.kind in ("document", "expr") and mask.is_causal):
        return causal, none
    if mask.kind == "causal":
        return (none,)
    return none, causal


def adapt(caps: Capabilities, c: Case) -> Case | None:
    """The nearest case the implementation declares support for, or None when none exists.

    It is `c` itself when `c` is supported. Otherwise each undeclared feature gives way to the
    nearest declared one:
    - layout: zigzag -> contiguous
    - mask: window -> causal, document -> causal or none, an expression -> causal or none
    - dtype: an undeclared dtype -> a declared one
    - heads: GQA -> as many kv heads as query heads, counts W does not divide -> multiples of W
    - a subgroup -> global ranks 0..W-1
    - split: uneven -> the nearest even one, odd zigzag local lengths -> even ones, an idle rank ->
      one token
    - a world size outside the range -> the nearest inside it, with the same total length
    - a call with a backward -> the same call under no_grad, for a forward-only ring
    - an undeclared input form -> contiguous

    An undeclared device has no substitute, so the answer is None. An implementation that declares
    fewer features thus gets the same world sizes, splits and values as every other, not fewer
    cases.
    """
    if not unsupported(caps, c):
        return c
    changes = _declared_substitutes(caps, c)
    if changes is None:
        return None
    changes.update(_feature_changes(caps, c))
    changes.update(_world_changes(caps, c))
    changes.update(_split_changes(caps, c, changes))
    changes.update(_head_changes(caps, c, changes))
    if "seq_lens" in changes:
        changes["mask"] = fit(changes.get("mask", c.mask), sum(changes["seq_lens"]))
    try:
        out = c.replace(**changes)
    # An adaptation that makes no valid case, e.g. too few tokens for the ranks.
    except Exception:
        return None
    return out if not unsupported(caps, out) else None


def _declared_substitutes(caps: Capabilities, c: Case) -> dict | None:
    """A declared layout, mask and dtype for undeclared ones, or None when one has none."""
    changes: dict = {}
    if c.layout not in caps.layouts:
        layout = next((x for x in LAYOUT_FALLBACK.get(c.layout, ()) if x in caps.layouts), None)
        if layout is None:
            return None
        changes["layout"] = layout
    if not c.mask.needs() <= caps.masks:
        mask = next((m for m in _mask_fallbacks(c.mask) if m.needs() <= caps.masks), None)
        if mask is None:
            return None
        changes["mask"] = mask
    if c.dtype not in caps.dtypes:
        dtype = next((x for x in DTYPE_FALLBACK.get(c.dtype, ()) if x in caps.dtypes), None)
        if dtype is None:
            return None
        changes["dtype"] = dtype
    return changes


def _feature_changes(caps: Capabilities, c: Case) -> dict:
    """Without GQA, subgroups, a backward or the input form: kv heads = query heads, global ranks,
    the call under no_grad, and contiguous inputs.
    """
    out: dict = {}
    if c.heads_q != c.heads_kv and not caps.gqa:
        out["heads_kv"] = c.heads_q
    if c.group_offset and not caps.subgroups:
        out["group_offset"] = 0
    if needs_backward(c.call) and not caps.backward:
        out["call"] = "no-grad"
    form = useful_form(
        out.get("call", c.call), c.inputs if c.inputs in caps.input_forms else "contiguous"
    )
    if form != c.inputs:
        out["inputs"] = form
    out.update({v: PLAIN_VARIANT[v] for v in c.variants if v not in caps.variants})
    out.update(_serving_changes(caps, c))
    return out


def _serving_changes(caps: Capabilities, c: Case) -> dict:
    """An undeclared inference shape gives way to training on the same tokens; an undeclared KV
    distribution to contiguous shares; replicated queries to owned ones."""
    req = c.serving
    if req is None or not [f for f in serving_features(req) if not _declares(caps, f)]:
        return {}
    if not _declares(caps, f"shape:{shape_of(req)}"):
        return {"serving": None}
    kv = req.kv if req.kv in caps.kv_layouts else "contiguous"
    queries = req.queries if req.queries in caps.queries else "own"
    if not _declares(caps, f"kv:{kv}"):
        return {"serving": None}
    page = req.page_size if "paged" in caps.input_forms else 0
    new = dataclasses.replace(req, kv=kv, queries=queries, page_size=page)
    return {"serving": new, "seq_lens": serving_seq_lens(new, c.world_size)}


def _world_changes(caps: Capabilities, c: Case) -> dict:
    """The nearest declared world size, with the same total length and the faults it still has."""
    world_size = min(max(c.world_size, caps.world_sizes[0]), caps.world_sizes[1])
    if world_size == c.world_size:
        return {}
    total = max(c.total_len, world_size)
    return {
        "world_size": world_size,
        "seq_lens": tuple(split_lengths(total, world_size)),
        "faults": tuple(f for f in c.faults if f.get("rank") is None or f["rank"] < world_size),
    }


def _split_changes(caps: Capabilities, c: Case, changes: dict) -> dict:
    """An even split for an uneven one, a token for an idle rank, even zigzag local lengths."""
    world_size = changes.get("world_size", c.world_size)
    lens = changes.get("seq_lens", tuple(c.seq_lens))
    out: dict = {}
    if len(set(lens)) > 1 and not caps.uneven:
        unit = 2 * world_size
        total = max(unit, (sum(lens) + unit - 1) // unit * unit)
        lens = out["seq_lens"] = tuple(split_lengths(total, world_size))
    # An idle rank gets one token, and the others keep theirs.
    if 0 in lens and not caps.idle_ranks:
        lens = out["seq_lens"] = tuple(max(1, int(n)) for n in lens)
    if changes.get("layout", c.layout) == "zigzag" and not caps.zigzag_odd and odd_lengths(lens):
        out["seq_lens"] = even_lengths(lens)
    return out


def _head_changes(caps: Capabilities, c: Case, changes: dict) -> dict:
    """Head counts the world size divides, and the nearest declared head dim."""
    world_size = changes.get("world_size", c.world_size)
    heads_q, heads_kv = c.heads_q, changes.get("heads_kv", c.heads_kv)
    out: dict = {}
    if caps.heads_divisible_by_world and (heads_q % world_size or heads_kv % world_size):
        out["heads_q"], out["heads_kv"] = divisible_heads(heads_q, heads_kv, world_size)
    if caps.head_dims is not None and c.head_dim not in caps.head_dims:
        out["head_dim"] = min(caps.head_dims, key=lambda d: abs(d - c.head_dim))
    sinks = changes.get("sinks", c.sinks)
    if "heads_q" in out and sinks is not None:  # one sink per query head, repeated as needed
        out["sinks"] = tuple(sinks[i % len(sinks)] for i in range(out["heads_q"]))
    return out


def without_inference(caps: Capabilities) -> Capabilities:
    """`caps` with the training shape alone: the check of `--no-inference` (as before #54)."""
    return dataclasses.replace(caps, shapes=frozenset({"train"}))


def without_variants(caps: Capabilities) -> Capabilities:
    """`caps` with no attention variant declared: the check of `--no-variants` (plain attention,
    as before #53)."""
    return dataclasses.replace(caps, **{v: False for v in VARIANTS})
