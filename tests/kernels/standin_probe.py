"""A rank-side implementation for tests/kernels/test_standin_ranks.py: one rank's attention through
whatever `flash_attn` the rank process imports (the CPU stand-in on gloo ranks without a real
flash-attn).

`KERNEL = "flash-attn"` makes the ranks report that kernel in their result (`reply["kernel"]`), as
for the ring-flash-attn and yunchang adapters. Used by module path:
`tests.kernels.standin_probe:impl`.
"""

from __future__ import annotations

import torch

from harness.context import Capabilities, Impl, RunContext

KERNEL = "flash-attn"


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    from flash_attn import flash_attn_func  # imported on the rank, after the worker's install()

    return flash_attn_func(q, k, v, softmax_scale=ctx.softmax_scale, causal=ctx.mask.is_causal)


impl = Impl(
    name="standin-probe",
    run=run,
    capabilities=Capabilities(
        layouts=frozenset({"contiguous"}),
        masks=frozenset({"none", "causal"}),
        dtypes=frozenset({"fp16", "bf16"}),
        world_sizes=(1, 1),
        devices=frozenset({"cpu"}),
    ),
)
