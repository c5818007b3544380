"""Implementations for the collective-fault and process-group tests (loaded as
tests.helpers.collective_impls:NAME).

`readme_ring` is the README's all-gather ring, read from the README as written. `group_in_run` and
`mesh_in_run` make a process group inside run (refused in one line); `local_group_in_run` makes a
local one of its own ranks, kept per ring group (allowed).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from harness.context import Impl
from ring_impl.ring import REFERENCE_PARTS, make_ring_attention

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_ring() -> Impl:
    block = re.search(r"```python\n(# myring\.py.*?)```", README.read_text(), re.S)
    assert block, "the README lost its adapter example"
    scope: dict = {}
    exec(compile(block.group(1), "README.md (myring.py)", "exec"), scope)
    return scope["my_ring"]


readme_ring = _readme_ring()
_reference = make_ring_attention(REFERENCE_PARTS)


def _ring(q, k, v, ctx, group=None):
    return _reference(
        q,
        k,
        v,
        group=group or ctx.group,
        layout=ctx.layout,
        lengths=ctx.lengths,
        mask=ctx.mask,
        softmax_scale=ctx.softmax_scale,
        return_lse=True,
    )


def _group_in_run(q, k, v, ctx):
    group = dist.new_group(ranks=list(ctx.global_ranks))  # collective over the whole pool
    return _ring(q, k, v, ctx, group)


def _mesh_in_run(q, k, v, ctx):
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", list(ctx.global_ranks))  # makes a group over the whole pool
    return _ring(q, k, v, ctx, mesh.get_group())


_LOCAL: dict[str, object] = {}


def _local_group_in_run(q, k, v, ctx):
    key = ctx.group.group_name
    if key not in _LOCAL:
        _LOCAL[key] = dist.new_group(list(ctx.global_ranks), use_local_synchronization=True)
    group = _LOCAL[key]
    one = torch.ones(1)
    dist.all_reduce(one, group=group)  # the local group works
    if one.item() != ctx.world_size:
        raise AssertionError(f"all_reduce over the local group gave {one.item()}")
    return _ring(q, k, v, ctx)


group_in_run = Impl("tests-group-in-run", _group_in_run)
mesh_in_run = Impl("tests-mesh-in-run", _mesh_in_run)
local_group_in_run = Impl("tests-local-group-in-run", _local_group_in_run)
