"""The attention variants as a case dimension: their draws and their battery cases (issue #53).

A variant is drawn only for an implementation that declares it. Each is drawn last and plain
first, so every other draw keeps its place and a failure shrinks towards plain attention.
Sink logits are drawn where they matter: zero (the usual initial value), at a row's lse and above
it. docs/case-model.md defines the variants.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from harness.context import Capabilities
from ring_impl.masks import MaskSpec

SINK_KINDS = ("zero", "lse", "above", "below")
CAPS = (1.0, 2.0, 5.0, 30.0, 50.0)  # Gemma 2 caps at 50 (attention) and 30 (final logits)


def sink_values(kind: str, heads_q: int, total_len: int) -> tuple[float, ...]:
    """One logit per query head of `kind`.

    A row's lse on unit values is about log of its visible keys: log(total_len) bounds it. `lse`
    sits there, `above` 3 to 5 above it (the sink takes most of the row), `below` 3 under it.
    Heads differ by a third of a unit, so a sink applied to the wrong head shows.
    """
    if kind == "zero":
        return (0.0,) * heads_q
    at = math.log(max(2, total_len))
    shift = {"lse": 0.0, "above": 4.0, "below": -3.0}[kind]
    return tuple(round(at + shift + (h % 3 - 1) / 3, 3) for h in range(heads_q))


def value_dims(head_dim: int, max_dim: int) -> list[int]:
    """Value head dims other than `head_dim`: MLA's ratios (1/2, 2/3) and a larger one."""
    dims = {max(1, head_dim // 2), max(1, 2 * head_dim // 3), min(max_dim, 2 * head_dim)}
    return sorted(d for d in dims if d != head_dim) or [head_dim + 1]


@st.composite
def variant_fields(
    draw, caps: Capabilities, heads_q: int, head_dim: int, total_len: int, max_dim: int = 256
) -> dict:
    """The case fields of the variants `caps` declares: each off (plain) three times in four.

    One draw opens the variants for half the cases, then each declared one is on in half of
    those: a variant comes as often as before, and a plain case stays plain more often (a variant
    case costs about 1.6 times a plain one: docs/check.md, "The attention variants")."""
    out: dict = {}
    declared = caps.variants
    if not declared or draw(st.integers(0, 1)) == 0:
        return out
    if "sinks" in declared and draw(st.integers(0, 1)) == 1:
        out["sinks"] = sink_values(draw(st.sampled_from(SINK_KINDS)), heads_q, total_len)
    if "softcap" in declared and draw(st.integers(0, 1)) == 1:
        out["softcap"] = draw(st.sampled_from(CAPS))
    if "alibi" in declared and draw(st.integers(0, 1)) == 1:
        out["alibi"] = True
    if "head_dim_v" in declared and draw(st.integers(0, 1)) == 1:
        out["head_dim_v"] = draw(st.sampled_from(value_dims(head_dim, max_dim)))
    return out


def battery_cases(w: int) -> list[dict]:
    """One battery case per variant and one with all four, seeded after every other case.

    Sinks at and above the rows' lse in bf16 (a dropped or doubled sink shows there), zero sinks
    in fp32; a cap that saturates large scores; ALiBi on shards whose local and global positions
    differ; value head dims below and above head_dim with GQA and MQA.
    """
    total, causal = 6 * w + 3, MaskSpec("causal")
    gqa = {"heads_q": 4, "heads_kv": 2}
    return [
        dict(layout="zigzag", mask=causal, dtype="bf16", head_dim=32, **gqa,
             sinks=sink_values("above", 4, total)),
        dict(layout="striped", mask=MaskSpec("none"), sinks=sink_values("zero", 2, total)),
        dict(layout="contiguous", mask=causal, values="large", head_dim=32, **gqa, softcap=50.0),
        dict(layout="zigzag", mask=MaskSpec("window", window=5), dtype="fp16", **gqa, alibi=True),
        dict(layout="striped", mask=causal, dtype="bf16", head_dim=32, head_dim_v=16, **gqa),
        dict(layout="contiguous", mask=MaskSpec("none"), heads_q=6, heads_kv=1, head_dim=16,
             head_dim_v=48),
        dict(layout="zigzag", mask=causal, seq_lens=_uneven(w), dtype="bf16", head_dim=32, **gqa,
             sinks=sink_values("lse", 4, sum(_uneven(w))), softcap=2.0, alibi=True, head_dim_v=24),
    ]  # fmt: skip


def _uneven(w: int) -> tuple[int, ...]:
    return tuple([5, 1, 9, 3][i % 4] + i // 4 for i in range(w)) if w > 1 else (7,)
