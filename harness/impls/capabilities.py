"""The capability rule, written once: which features a run asks for that an implementation does not
declare. The case side (`unsupported`, before a run: check, fault battery) and the rank side (the
adapters' `require_supported`, inside a run) both call `missing_features`.

Also here: the nearest supported variant of a case (`adapt`) and the capability matrix (feature x
declared / passed / failed, plus what an undeclared feature really does when probed).

Feature keys are `kind:value` strings or bare flags: "layout:zigzag", "mask:window", "dtype:fp32",
"world:9", "gqa" / "mqa", "heads" (a head count W does not divide), "uneven", "idle" (a rank with no
token), "zigzag-odd" (an odd local length in the zigzag layout), "head_dim:13", "subgroup",
"device:cuda", "backward" (a call with a backward: train or checkpoint), "inputs:fused-qkv" (an
input form, harness.calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from harness.calls import needs_backward, useful_form
from harness.context import Capabilities
from ring_impl.masks import MASK_FEATURES, MaskSpec, fit

if TYPE_CHECKING:  # annotations only: the adapters import this module inside the ranks
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
) -> list[str]:
    """The feature keys of a run that `caps` does not declare, in a fixed order (empty: supported).

    `subgroup` (the ring is not global ranks 0..W-1) and `device` (the tensors') may be None: not
    known at this point, so not checked. So may `call` and `inputs` (harness.calls). `mask_kind`: a
    mask (every capability name it needs: `MaskSpec.needs`, e.g. an expression needs "expr", its
    primitives and its combinators) or one name.
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
    return missing


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
    return f"{kind} {value}" if value else kind  # layout, mask, dtype, head_dim


def odd_lengths(lengths: Sequence[int]) -> bool:
    """Whether some local length is odd (in the zigzag layout: a rank's two chunks differ in
    size)."""
    return any(int(n) % 2 for n in lengths)


def even_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    """Every odd local length rounded up to the next even one (an even split of N -> one of N
    rounded up to a multiple of 2W)."""
    return tuple(int(n) + int(n) % 2 for n in lengths)


def divisible_heads(heads_q: int, heads_kv: int, world_size: int) -> tuple[int, int]:
    """The nearest (heads_q, heads_kv), rounded up, that `world_size` divides both of: kv heads
    up to a multiple of W, query heads up to a multiple of those; GQA/MQA stays grouped (at least
    2 query heads per kv head), MHA stays MHA. E.g. (4, 1) at W=3 -> (6, 3); (2, 2) at W=4 -> (4,
    4)."""
    kv = -(-heads_kv // world_size) * world_size
    q = -(-heads_q // kv) * kv
    if heads_q > heads_kv and q == kv:
        q = 2 * kv
    return q, kv


def case_features(c: Case) -> list[str]:
    """The features a case exercises, as `kind:value` strings (the capability matrix's rows)."""
    feats = [
        f"layout:{c.layout}",
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
    return feats


def unsupported(caps: Capabilities, c: Case, device: str | None = None) -> list[str]:
    """Features of the case that the implementation does not declare (empty: fully supported).

    The tensors' device is checked only when given (a case does not name one; the pool decides it).
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
    )


def declare(caps: Capabilities, feature: str) -> Capabilities:
    """`caps` with one more feature declared (a key of `missing_features`): what a probe of that
    feature adapts the rest of its case to."""
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
}


def dimension(feature: str) -> str:
    """The dimension a feature key belongs to ('mask', 'split', 'heads'), or the key itself."""
    return _DIMENSIONS.get(feature.partition(":")[0], feature)


def isolated_probe(caps: Capabilities, c: Case, feature: str) -> Case | None:
    """`c` with every undeclared feature outside `feature`'s dimension adapted away, so that a run
    of it probes that one dimension (e.g. an undeclared mask expression, or an idle rank) on an
    otherwise declared case; None when no such case exists."""
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
    """window -> causal; causal document -> causal, none; bidirectional document -> none, causal; an
    expression -> causal, none when it is causal, else none, causal."""
    causal, none = MaskSpec("causal"), MaskSpec("none")
    if mask.kind == "window" or (mask.kind in ("document", "expr") and mask.is_causal):
        return causal, none
    if mask.kind == "causal":
        return (none,)
    return none, causal


def adapt(caps: Capabilities, c: Case) -> Case | None:
    """The nearest case the implementation declares support for: `c` itself when it does; else the
    undeclared features replaced by the nearest declared ones (zigzag -> contiguous, window ->
    causal, document -> causal or none, an undeclared dtype -> a declared one, GQA -> as many kv
    heads as query heads, a subgroup -> global ranks 0..W-1, an uneven split -> the nearest even
    one, a world size outside the range -> the nearest inside it, with the same total length; a call
    with a backward -> the same call under no_grad (a forward-only ring), an undeclared input form
    -> contiguous; odd zigzag local lengths -> rounded up to even ones, head counts W does not
    divide -> rounded up to multiples of W, an idle rank -> one token; an undeclared mask expression
    -> causal or none); None when none exists (e.g. an undeclared device). So an implementation that
    declares fewer features gets the same world sizes, splits and values as every other, not fewer
    cases (issue #17)."""
    from ring_impl.layouts import split_lengths

    if not unsupported(caps, c):
        return c
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
    if c.heads_q != c.heads_kv and not caps.gqa:
        changes["heads_kv"] = c.heads_q
    if c.group_offset and not caps.subgroups:
        changes["group_offset"] = 0
    if needs_backward(c.call) and not caps.backward:
        changes["call"] = "no-grad"
    form = useful_form(
        changes.get("call", c.call), c.inputs if c.inputs in caps.input_forms else "contiguous"
    )
    if form != c.inputs:
        changes["inputs"] = form
    world_size = min(max(c.world_size, caps.world_sizes[0]), caps.world_sizes[1])
    total = max(c.total_len, world_size)
    if world_size != c.world_size:
        changes["world_size"] = world_size
        changes["seq_lens"] = tuple(split_lengths(total, world_size))
        changes["faults"] = tuple(
            f for f in c.faults if f.get("rank") is None or f["rank"] < world_size
        )
    lens = changes.get("seq_lens", tuple(c.seq_lens))
    if len(set(lens)) > 1 and not caps.uneven:
        unit = 2 * world_size
        total = max(unit, (sum(lens) + unit - 1) // unit * unit)
        changes["seq_lens"] = tuple(split_lengths(total, world_size))
    lens = changes.get("seq_lens", tuple(c.seq_lens))
    if 0 in lens and not caps.idle_ranks:  # an idle rank gets one token (the others keep theirs)
        changes["seq_lens"] = tuple(max(1, int(n)) for n in lens)
    lens = changes.get("seq_lens", tuple(c.seq_lens))
    if changes.get("layout", c.layout) == "zigzag" and not caps.zigzag_odd and odd_lengths(lens):
        changes["seq_lens"] = even_lengths(lens)
    heads_q, heads_kv = c.heads_q, changes.get("heads_kv", c.heads_kv)
    if caps.heads_divisible_by_world and (heads_q % world_size or heads_kv % world_size):
        changes["heads_q"], changes["heads_kv"] = divisible_heads(heads_q, heads_kv, world_size)
    if caps.head_dims is not None and c.head_dim not in caps.head_dims:
        changes["head_dim"] = min(caps.head_dims, key=lambda d: abs(d - c.head_dim))
    if "seq_lens" in changes:
        changes["mask"] = fit(changes.get("mask", c.mask), sum(changes["seq_lens"]))
    try:
        out = c.replace(**changes)
    except Exception:  # an adaptation that makes no valid case (e.g. too few tokens for the ranks)
        return None
    return out if not unsupported(caps, out) else None
