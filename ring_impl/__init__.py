"""Reference ring attention (context parallelism), judged by the harness against float64
attention."""

from ring_impl.masks import MaskSpec
from ring_impl.ring import (
    REFERENCE_PARTS,
    RingParts,
    make_ring_attention,
    ring_attention,
    ring_attention_forward,
)

__all__ = [
    "MaskSpec",
    "REFERENCE_PARTS",
    "RingParts",
    "make_ring_attention",
    "ring_attention",
    "ring_attention_forward",
]
