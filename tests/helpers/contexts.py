"""Run contexts and declared capabilities for the adapters' tests."""

from __future__ import annotations

import torch

from harness.context import Capabilities, RunContext
from harness.impls import registry
from ring_impl.layouts import all_positions
from ring_impl.masks import MaskSpec


def make_ctx(layout="contiguous", lengths=(8, 8), mask=None, rank=0, device="cpu", scale=0.25):
    mask = MaskSpec("causal") if mask is None else mask
    pos = tuple(all_positions(layout, list(lengths)))
    return RunContext(
        group=None,
        rank=rank,
        world_size=len(lengths),
        global_ranks=tuple(range(len(lengths))),
        layout=layout,
        lengths=tuple(lengths),
        all_positions=pos,
        mask=mask,
        softmax_scale=scale,
        dtype=torch.float32,
        device=torch.device(device),
    )


def caps_of(name: str) -> Capabilities:
    caps = registry.declared_capabilities(name)
    assert caps is not None, name
    return caps
