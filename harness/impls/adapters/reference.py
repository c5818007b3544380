"""The project's own reference ring (`ring_impl.ring_attention`): every layout, mask, dtype, split.

`wrap` turns any function with the `ring_attention` signature into an `Impl`; `make` uses it for the
reference and `mutant` for the bug variants in `ring_impl.mutants` (`mutant:NAME`, selftest only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from harness.context import PAGED, SHAPES, Capabilities, Impl, RunContext
from harness.impls.adapters._common import Variant, installed_version, variant
from ring_impl.masks import MASK_FEATURES

EXTRA = None  # part of the project itself
# every mask of the mask language (ring_impl.masks); the mutants' too: they are wrapped alike
REFERENCE_CAPABILITIES = Capabilities(
    returns_lse=True,
    masks=frozenset(MASK_FEATURES),
    idle_ranks=True,
    sinks=True,
    softcap=True,
    alibi=True,
    head_dim_v=True,
)
VARIANTS = {"reference": Variant(REFERENCE_CAPABILITIES)}
# the references of the inference shapes (harness.impls.adapters.serving) and the decode mutants
PASS_KV_CAPABILITIES = dataclasses.replace(
    REFERENCE_CAPABILITIES,
    shapes=frozenset(SHAPES),
    input_forms=REFERENCE_CAPABILITIES.input_forms | {PAGED},
)
DECODE_CAPABILITIES = dataclasses.replace(
    PASS_KV_CAPABILITIES, queries=frozenset({"own", "replicated"}), backward=False
)

MUTANT_PREFIX = "mutant:"


def wrap(ring_attention: Callable[..., Any], name: str) -> Impl:
    """An Impl calling `ring_attention` with everything the context says; returns (out, lse)."""

    def run(q: Any, k: Any, v: Any, ctx: RunContext) -> Any:
        given = dict(
            group=ctx.group,
            layout=ctx.layout,
            lengths=ctx.lengths,
            mask=ctx.mask,
            softmax_scale=ctx.softmax_scale,
            return_lse=True,
            **variant_arguments(ctx),
        )
        return ring_attention(q, k, v, **{**given, **serving_arguments(ctx)})

    return Impl(
        name=name,
        run=run,
        capabilities=REFERENCE_CAPABILITIES,
        version=installed_version("ring-harness"),
    )


def variant_arguments(ctx: RunContext) -> dict:
    """The variants of the run as ring_attention's keyword arguments, only those it uses.

    A plain run passes none, so a mutant older than the variants is called as it always was.
    """
    given = {"sinks": ctx.sinks, "softcap": ctx.softcap, "alibi_slopes": ctx.alibi_slopes}
    return {name: value for name, value in given.items() if value is not None}


def serving_arguments(ctx: RunContext) -> dict:
    """An inference shape's positions and its mask within each request, for ring_attention.

    A training run passes none, so every mutant is called as it always was."""
    if ctx.serving is None:
        return {}
    from ring_impl.serving import mask_within

    paged = {} if ctx.pages is None else {"pages": ctx.pages}
    return {
        "positions": ctx.all_positions,
        "q_positions": ctx.q_positions,
        "mask": mask_within(ctx.mask, ctx.serving.starts),
        **paged,
    }


def decode_arguments(ctx: RunContext) -> dict:
    """What `decode_attention` needs from the context: positions, queries, the mask, variants."""
    from ring_impl.serving import mask_within

    q_all = ctx.all_positions if ctx.query_positions is None else ctx.query_positions
    mask = ctx.mask if ctx.serving is None else mask_within(ctx.mask, ctx.serving.starts)
    return dict(
        positions=ctx.all_positions,
        q_positions=q_all,
        replicated=ctx.serving is not None and ctx.serving.queries == "replicated",
        group=ctx.group,
        mask=mask,
        softmax_scale=ctx.softmax_scale,
        requests=ctx.serving,
        **variant_arguments(ctx),
        **({} if ctx.pages is None else {"pages": ctx.pages}),
    )


def wrap_decode(fn: Callable[..., Any], name: str, form: str) -> Impl:
    """An Impl calling `fn` (the `decode_attention` signature, plus `requests`) in merge `form`."""

    def run(q: Any, k: Any, v: Any, ctx: RunContext) -> Any:
        return fn(q, k, v, form=form, **decode_arguments(ctx))

    return Impl(
        name=name,
        run=run,
        capabilities=DECODE_CAPABILITIES,
        version=installed_version("ring-harness"),
    )


def make(name: str) -> Impl:
    """The reference ring (`name` is "reference", the one entry of VARIANTS)."""
    from ring_impl import ring_attention

    variant(VARIANTS, name)
    return wrap(ring_attention, name)


def mutant_names() -> list[str]:
    """`mutant:NAME` for every bug variant in ring_impl.mutants, in the zoo's order."""
    from ring_impl.mutants import MUTANTS

    return [MUTANT_PREFIX + n for n in MUTANTS]


def profile_mutant_names() -> list[str]:
    """`mutant:NAME` for the mutants of `profile` (ring_impl.mutants.profile): right numbers."""
    from ring_impl.mutants.profile import PROFILE_MUTANTS

    return [MUTANT_PREFIX + n for n in PROFILE_MUTANTS]


def mutant(name: str) -> Impl:
    """The bug variant `mutant:NAME` (or bare NAME) wrapped exactly like the reference; KeyError if
    unknown. The profile mutants resolve too; selftest never lists them."""
    from ring_impl.mutants import MUTANTS
    from ring_impl.mutants.profile import PROFILE_MUTANTS

    short = name.removeprefix(MUTANT_PREFIX)
    fn = {**MUTANTS, **PROFILE_MUTANTS}[short]
    form = getattr(fn, "decode_form", None)
    if form is not None:  # a mutant of the decode reference (ring_impl.mutants.serving)
        return wrap_decode(fn, MUTANT_PREFIX + short, form)
    return wrap(fn, MUTANT_PREFIX + short)
