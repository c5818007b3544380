"""The inference shapes as a case dimension: their draws and their battery cases (issue #54).

A serving case is drawn only for an implementation that declares a shape beyond training, and
each draw keeps training first, so a failure shrinks towards the training shape. Requests are
ragged: a few of them, each with its own cached context (zero included) and new tokens (one for
decode, a few for speculative decoding, a chunk for prefill). The KV is spread by a declared
distribution, interleaved in blocks of I tokens too; the queries are owned or replicated.
docs/case-model.md defines the shapes.
"""

from __future__ import annotations

from hypothesis import strategies as st

from harness.calls import needs_backward
from harness.context import PAGED, Capabilities
from ring_impl.masks import MaskSpec
from ring_impl.serving import KV_LAYOUTS

NEW_TOKENS = (1, 1, 2, 4, 8)  # decode, decode, speculative, speculative, a prefill chunk
INTERLEAVES = (1, 2, 4, 16)
PAGE_SIZES = (0, 1, 2, 16, 64)  # 0: contiguous shares; a paged cache's page sizes
CAUSAL = MaskSpec("causal")


def declares_inference(caps: Capabilities) -> bool:
    """Whether `caps` declares a shape beyond training."""
    return bool(caps.shapes - {"train"})


def _mask(draw, caps: Capabilities) -> MaskSpec:
    """Causal mostly (engines' causal decode), else a window or none, as declared."""
    options = [CAUSAL] * 3 + [MaskSpec("window", window=5), MaskSpec("none")]
    options = [m for m in options if m.needs() <= caps.masks] or [MaskSpec("none")]
    return draw(st.sampled_from(options))


@st.composite
def serving_fields(draw, caps: Capabilities, world_size: int, call: str, max_context: int = 48):
    """A serving mapping and the fields that go with it, or {} (the training shape) half the time.

    `call` is the drawn call: a serving case runs under inference_mode unless the implementation
    declares a backward and the drawn call has one."""
    if not declares_inference(caps) or draw(st.integers(0, 1)) == 0:
        return {}
    n = draw(st.integers(1, 3))
    shapes = caps.shapes - {"train"}
    decode = "decode" in shapes and ("prefill" not in shapes or draw(st.booleans()))
    new = [1] * n if decode else [draw(st.sampled_from(NEW_TOKENS[2:])) for _ in range(n)]
    context = [draw(st.integers(0, max_context)) for _ in range(n)]
    kv = draw(st.sampled_from([d for d in KV_LAYOUTS if d in caps.kv_layouts]))
    interleave = draw(st.sampled_from(INTERLEAVES)) if kv == "interleaved" else 1
    queries = draw(st.sampled_from(sorted(caps.queries)))
    if not caps.idle_ranks:  # every rank holds some KV: the first request is long enough
        context[0] = max(context[0], world_size * interleave)
    serving = {"context": context, "new": new, "kv": kv, "interleave": interleave}
    if queries != "own":
        serving["queries"] = queries
    if PAGED in caps.input_forms:  # contiguous shares first: a failure shrinks towards them
        serving["page_size"] = draw(st.sampled_from(PAGE_SIZES))
    out = {"serving": serving, "mask": _mask(draw, caps)}
    out["call"] = call if needs_backward(call) and caps.backward else "inference-mode"
    return out


def battery_cases(w: int, caps: Capabilities) -> list[dict]:
    """The inference shapes' battery, for an implementation that declares them.

    Decode over every declared KV distribution, interleaved by 1 and by I > 1; ragged requests, one
    with no cached context; several new tokens per request; a window that leaves some rank no
    visible key for a row; replicated queries where declared; sinks and GQA in bf16; a paged KV
    cache with pages of 1, 4 and 16 tokens where declared.
    """
    if not declares_inference(caps):
        return []
    inf, ragged = "inference-mode", [3 * w + 5, 2, 0]
    cases = [
        dict(serving=dict(context=[5 * w + 3], new=[1], kv="interleaved", interleave=1)),
        dict(serving=dict(context=ragged, new=[1, 1, 1], kv="interleaved", interleave=4),
             heads_q=4, heads_kv=1),
        dict(serving=dict(context=[4 * w + 1, w + 2], new=[1, 1], kv="contiguous")),
        dict(serving=dict(context=[4 * w + 1, w], new=[1, 1], kv="striped"), dtype="bf16",
             heads_q=4, heads_kv=2, head_dim=32),
        dict(serving=dict(context=[4 * w + 1, 3], new=[1, 1], kv="zigzag")),
        dict(serving=dict(context=[3 * w, 2 * w + 1, 0], new=[4, 2, 3], kv="interleaved",
                          interleave=2)),
        dict(serving=dict(context=[6 * w + 1], new=[3], kv="interleaved", interleave=4),
             mask=MaskSpec("window", window=3)),
        dict(serving=dict(context=[2 * w + 3, 5], new=[8, 2], kv="striped"), dtype="fp16"),
        dict(serving=dict(context=[3 * w + 2, 7], new=[1, 2], kv="interleaved", interleave=2,
                          queries="replicated"), heads_q=4, heads_kv=2),
        dict(serving=dict(context=[5 * w, 1], new=[1, 1], kv="interleaved", interleave=16,
                          queries="replicated"), dtype="bf16", sinks=(2.5, 3.0)),
        dict(serving=dict(context=[4 * w + 2, 2 * w + 1], new=[1, 1], kv="contiguous",
                          page_size=4)),
        dict(serving=dict(context=ragged, new=[2, 1, 1], kv="interleaved", interleave=2,
                          page_size=1), heads_q=4, heads_kv=2),
        dict(serving=dict(context=[6 * w + 5], new=[3], kv="interleaved", interleave=4,
                          page_size=16), dtype="bf16"),
    ]  # fmt: skip
    out = []
    for kw in cases:
        kw.setdefault("mask", CAUSAL)
        kw.setdefault("call", inf)
        req = kw["serving"]
        if req.get("queries", "own") not in caps.queries or req["kv"] not in caps.kv_layouts:
            continue
        if "sinks" in kw and not caps.sinks:
            continue
        if req.get("page_size") and PAGED not in caps.input_forms:
            continue
        shape = "decode" if max(req["new"]) == 1 else "prefill"
        if shape in caps.shapes and kw["mask"].needs() <= caps.masks:
            out.append(kw)
    return out
