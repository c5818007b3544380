"""The project's own reference ring (`ring_impl.ring_attention`): every layout, mask, dtype, split.

`wrap` turns any function with the `ring_attention` signature into an `Impl`; the registry uses it
for the reference and for the bug variants in `ring_impl.mutants` (`mutant:NAME`, selftest only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.context import Capabilities, Impl, RunContext

EXTRA = None  # part of the project itself
CAPABILITIES = {"reference": Capabilities(returns_lse=True)}
MUTANT_PREFIX = "mutant:"


def wrap(ring_attention: Callable[..., Any], name: str) -> Impl:
    """An Impl calling `ring_attention` with everything the context says; returns (out, lse)."""

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

    from harness.impls.adapters._common import installed_version

    return Impl(name=name, run=run, capabilities=CAPABILITIES["reference"], version=installed_version("ring-harness"))


def impl() -> Impl:
    """The reference ring."""
    from ring_impl import ring_attention

    return wrap(ring_attention, "reference")


def mutant_names() -> list[str]:
    """`mutant:NAME` for every bug variant in ring_impl.mutants, in the zoo's order."""
    from ring_impl.mutants import MUTANTS

    return [MUTANT_PREFIX + n for n in MUTANTS]


def mutant(name: str) -> Impl:
    """The bug variant `mutant:NAME` (or bare NAME) wrapped exactly like the reference; KeyError if unknown."""
    from ring_impl.mutants import MUTANTS

    short = name.removeprefix(MUTANT_PREFIX)
    return wrap(MUTANTS[short], MUTANT_PREFIX + short)
