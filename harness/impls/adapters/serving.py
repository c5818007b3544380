"""The project's own references for inference shapes (issue #54): pass-KV prefill and decode.

- `reference-pass-kv`: the reference ring; a serving case's queries are the new tokens each rank
  holds the KV of, and the KV rides the ring (prefill onto a cache). Forward and backward.
- `reference-pass-q`: the pass-Q ring (`ring_impl.pass_q`): the query blocks and their partials
  ride the ring, the KV cache stays put. Forward only; owned queries.
- `reference-decode`, `reference-decode-a2a`: gathered queries, each rank's partial attention over
  its KV share, merged by lse with an all-gather or an all-to-all (`ring_impl.decode`). Forward
  only; queries owned or replicated. A training case runs the same way, its queries its tokens.

The decode mutants (`ring_impl.mutants.serving`) are wrapped by `reference.wrap_decode` like these.
"""

from __future__ import annotations

import dataclasses

from harness.context import Impl
from harness.impls.adapters._common import Variant, variant
from harness.impls.adapters.reference import (
    DECODE_CAPABILITIES,
    PASS_KV_CAPABILITIES,
    wrap,
    wrap_decode,
)

EXTRA = None  # part of the project itself
PASS_Q_CAPABILITIES = dataclasses.replace(DECODE_CAPABILITIES, queries=frozenset({"own"}))
VARIANTS = {
    "reference-pass-kv": Variant(PASS_KV_CAPABILITIES),
    "reference-decode": Variant(DECODE_CAPABILITIES, option="all-gather"),
    "reference-decode-a2a": Variant(DECODE_CAPABILITIES, option="all-to-all"),
    "reference-pass-q": Variant(PASS_Q_CAPABILITIES, option="pass-q"),
}


def _decode(q, k, v, *, requests=None, **given):
    from ring_impl.decode import decode_attention

    return decode_attention(q, k, v, **given)


def _pass_q(q, k, v, *, requests=None, replicated=False, form=None, **given):
    from ring_impl.pass_q import pass_q_attention

    return pass_q_attention(q, k, v, **given)


def make(name: str) -> Impl:
    """One of VARIANTS: the pass-KV ring, or decode with the option's merge form."""
    chosen = variant(VARIANTS, name)
    if name == "reference-pass-kv":
        from ring_impl import ring_attention

        impl = wrap(ring_attention, name)
        return dataclasses.replace(impl, capabilities=PASS_KV_CAPABILITIES)
    if name == "reference-pass-q":
        impl = wrap_decode(_pass_q, name, chosen.option)
        return dataclasses.replace(impl, capabilities=PASS_Q_CAPABILITIES)
    return wrap_decode(_decode, name, chosen.option)
