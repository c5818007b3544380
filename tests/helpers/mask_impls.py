"""Implementations that declare only the original masks (none, causal), for the mask-language probes
(loaded as tests.helpers.mask_impls:NAME): one reads only `ctx.mask.is_causal` and so silently runs
any expression as plain causal or no mask, the other refuses what it does not declare, as the
adapters do."""

from __future__ import annotations

from harness.context import Capabilities, Impl
from harness.impls.adapters._common import require_supported
from ring_impl import ring_attention
from ring_impl.masks import MaskSpec

NARROW = Capabilities(masks=frozenset({"none", "causal"}))


def _mask_blind(q, k, v, ctx):
    """causal or nothing: an expression is neither refused nor applied."""
    mask = MaskSpec("causal") if ctx.mask.is_causal else MaskSpec("none")
    return ring_attention(
        q,
        k,
        v,
        group=ctx.group,
        layout=ctx.layout,
        lengths=ctx.lengths,
        mask=mask,
        softmax_scale=ctx.softmax_scale,
    )


def _refusing(q, k, v, ctx):
    require_supported("tests-refusing", ctx, NARROW, q, k)
    return _mask_blind(q, k, v, ctx)


mask_blind = Impl("tests-mask-blind", _mask_blind, capabilities=NARROW)
refusing = Impl("tests-refusing", _refusing, capabilities=NARROW)
