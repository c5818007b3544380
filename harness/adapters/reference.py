"""The project's own reference ring (`ring_impl.ring_attention`): every layout, mask, dtype, split."""

from __future__ import annotations

from harness.context import Capabilities, Impl, RunContext

EXTRA = None  # part of the project itself
CAPABILITIES = {"reference": Capabilities(returns_lse=True)}


def impl() -> Impl:
    """The reference ring, called with everything the context says; returns (out, lse)."""
    from ring_impl import ring_attention

    def run(q, k, v, ctx: RunContext):
        return ring_attention(
            q,
            k,
            v,
            group=ctx.group,
            layout=ctx.layout,
            lengths=ctx.lengths,
            mask=ctx.mask,
            softmax_scale=ctx.softmax_scale,
            return_lse=True,
        )

    from harness.adapters._common import installed_version

    return Impl(
        name="reference",
        run=run,
        capabilities=CAPABILITIES["reference"],
        version=installed_version("ring-harness"),
    )
