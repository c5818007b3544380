"""Adapters with the mistakes a new user makes (tests/commands/test_adapter_errors.py): each must
end in one line and exit 2, never in a traceback or exit 1. Module paths:
tests.helpers.adapter_mistakes:NAME."""

from __future__ import annotations

from harness import Capabilities, Impl
from harness.impls import registry

_ref = registry.resolve("reference")

# tuples and lists where the fields are sets: accepted as they are
tuples = Impl(
    "tuples",
    _ref.run,
    capabilities=Capabilities(
        layouts=("contiguous", "zigzag"),
        dtypes=["fp32", "bf16"],
        masks=("none", "causal"),
        head_dims=[16, 32],
    ),
)


def _typo(q, k, v, ctx):
    return _ref.run(q, k, v, ctx.lenghts)  # misspelled: RunContext.lengths


typo = Impl("typo", _typo, capabilities=Capabilities(layouts=("contiguous",)))


def _short(q, k, v, ctx):
    out, lse = _ref.run(q, k, v, ctx)
    return out[:, :-1], lse


short = Impl("short", _short)


def unknown_layout():
    return Impl("unknown", _ref.run, capabilities=Capabilities(layouts=("contiguous", "zig-zag")))


def misspelled_field():
    return Impl("misspelled", _ref.run, capabilities=Capabilities(layout=("zigzag",)))
